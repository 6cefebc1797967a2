# Two entry points that work on a fresh machine (Python 3.10+, a C compiler):
#   make demo   - build fastlock into .venv, start a server and worker processes writing a fenced ledger
#   make test   - build fastlock into .venv and run the test suite against the installed package
#                 on TEST_WORKERS pytest-xdist workers (default 2; each async test on one event loop;
#                 make test-both-loops: on asyncio and uvloop; make test-serial: in one process, for
#                 debugging; make test-quick: only the tests that start no server process through a fixture)
# and for users and operators (docs/install.md):
#   make wheel  - dist/: an sdist and a wheel that installs into any venv without Cython or a compiler
#   make install [PREFIX=/usr/local] [EXTRAS=metrics] - a venv in PREFIX/lib/fastlock and the command
#                 PREFIX/bin/fastlock (where deploy/fastlock.service runs it)
#   make docs   - the documentation site in site/ (mkdocs build --strict: a warning fails it)
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.fastlock-installed
SOURCES := $(wildcard fastlock/*.py fastlock/*/*.py fastlock/*.pyx fastlock/*.pxi fastlock/*/*.pyx fastlock/*.pxd fastlock/*.pyi) setup.py pyproject.toml Makefile

PREFIX ?= /usr/local
EXTRAS ?= metrics
# what `make install` installs: the wheel `make wheel` built, else the source tree
INSTALL_FROM = $(or $(firstword $(wildcard dist/fastlock-*.whl)),.)

.PHONY: demo test test-serial test-quick test-both-loops serve bench clean dist wheel wheel-check install docs

$(STAMP): $(SOURCES)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -U pip
	rm -rf build/lib.*  # setuptools never removes a moved module's old copy from build/lib
	@echo "fastlock: installing into $(VENV) with its test tools, then compiling the Cython core"
	@echo "fastlock: (fastlock/_core.pyx, fastlock/wal/_syncer.pyx, fastlock/*/_wire.pyx): about 2 minutes on 2 cores the first time"
	$(VENV)/bin/python -m pip install --progress-bar off ".[test,postgres,metrics]"
	# the same compiled modules beside their sources, so that commands run from the repository root
	# (python -m benches.load, python -m fastlock.wal dump), where ./fastlock is imported, find them
	cd build/lib.* && find fastlock -name '*.so' -exec cp {} $(CURDIR)/{} \;
	touch $@

demo: $(STAMP)
	$(VENV)/bin/fastlock demo

# run from tests/: subprocesses (`python -m fastlock ...`) then import the installed
# package, never the uncompiled source tree.  The suite mostly waits on server processes, so
# TEST_WORKERS processes (pytest-xdist) share the cores; --dist loadgroup keeps each test file on
# one worker and the heavy tests (tests/conftest.py's HEAVY_FILES, HEAVY_TESTS) one after another on one worker.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup

test: $(STAMP)
	cd tests && $(CURDIR)/$(VENV)/bin/pytest -q $(PARALLEL)

test-serial: $(STAMP)
	cd tests && $(CURDIR)/$(VENV)/bin/pytest -q

test-quick: $(STAMP)
	cd tests && $(CURDIR)/$(VENV)/bin/pytest -q -x -m "not integration"

test-both-loops: $(STAMP)
	cd tests && FASTLOCK_BOTH_LOOPS=1 $(CURDIR)/$(VENV)/bin/pytest -q $(PARALLEL)

serve: $(STAMP)
	$(VENV)/bin/fastlock serve

bench: $(STAMP)
	$(VENV)/bin/python -m benches.load --quick

# an sdist and a wheel built from it (the wheel needs no Cython or compiler to install)
dist: $(STAMP)
	rm -rf dist
	@echo "fastlock: building dist/ (compiles the Cython core again, from the sdist: about a minute)"
	$(VENV)/bin/python -m build --outdir dist .

wheel: dist

# a venv of its own in PREFIX/lib/fastlock and PREFIX/bin/fastlock linked to its command
install:
	@echo "fastlock: installing $(INSTALL_FROM)[$(EXTRAS)] into $(PREFIX)/lib/fastlock"
	test -x $(PREFIX)/lib/fastlock/bin/python || $(PYTHON) -m venv $(PREFIX)/lib/fastlock
	$(PREFIX)/lib/fastlock/bin/python -m pip install -q --progress-bar off "$(INSTALL_FROM)[$(EXTRAS)]"
	mkdir -p $(PREFIX)/bin
	ln -sf ../lib/fastlock/bin/fastlock $(PREFIX)/bin/fastlock
	$(PREFIX)/bin/fastlock --version

# the documentation site; mkdocs, the Material theme and mkdocstrings come with the docs extra
docs: $(VENV)/.fastlock-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

$(VENV)/.fastlock-docs: $(STAMP) pyproject.toml
	$(VENV)/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))' > $(VENV)/docs-requirements.txt
	$(VENV)/bin/python -m pip install -q --progress-bar off -r $(VENV)/docs-requirements.txt
	touch $@

# install the wheel into a fresh venv without Cython and take a lock through it
wheel-check: dist
	$(VENV)/bin/python tests/wheel_check.py dist

clean:
	rm -rf build dist site $(VENV) $(patsubst %.pyx,%.c,$(wildcard fastlock/*.pyx fastlock/*/*.pyx)) fastlock/*.so fastlock/*/*.so fastlock/*.html fastlock/*/*.html *.egg-info
