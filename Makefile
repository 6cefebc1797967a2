# Two entry points that work on a fresh machine (Python 3.10+, a C compiler):
#   make demo   - build fastlock into .venv, start a server and worker processes writing a fenced ledger
#   make test   - build fastlock into .venv and run the test suite against the installed package
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.fastlock-installed
SOURCES := $(wildcard fastlock/*.py fastlock/*/*.py fastlock/*.pyx fastlock/*/*.pyx fastlock/*.pxd fastlock/*.pyi) setup.py pyproject.toml

.PHONY: demo test serve bench clean dist wheel-check

$(STAMP): $(SOURCES)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -U pip
	rm -rf build/lib.*  # setuptools never removes a moved module's old copy from build/lib
	$(VENV)/bin/python -m pip install -q ".[test,postgres,metrics]"
	# the same compiled modules beside their sources, so that commands run from the repository root
	# (python -m benches.load, python -m fastlock.wal dump), where ./fastlock is imported, find them
	cd build/lib.* && find fastlock -name '*.so' -exec cp {} $(CURDIR)/{} \;
	touch $@

demo: $(STAMP)
	$(VENV)/bin/fastlock demo

# run from tests/: subprocesses (`python -m fastlock ...`) then import the installed
# package, never the uncompiled source tree
test: $(STAMP)
	cd tests && $(CURDIR)/$(VENV)/bin/pytest -q

serve: $(STAMP)
	$(VENV)/bin/fastlock serve

bench: $(STAMP)
	$(VENV)/bin/python -m benches.load --quick

# an sdist and a wheel built from it (the wheel needs no Cython or compiler to install)
dist: $(STAMP)
	rm -rf dist
	$(VENV)/bin/python -m build --outdir dist .

# install the wheel into a fresh venv without Cython and take a lock through it
wheel-check: dist
	$(VENV)/bin/python tests/wheel_check.py dist

clean:
	rm -rf build dist $(VENV) fastlock/_core.c fastlock/wal/_syncer.c fastlock/*.so fastlock/*/*.so fastlock/*.html fastlock/*/*.html *.egg-info
