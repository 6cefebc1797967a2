"""``fastlock credentials sequencer-key DIR``: list, add, switch, retire and export the
group's sequencer keys (:mod:`fastlock.auth.sequencer_keys`)."""

from __future__ import annotations

import argparse
import os

from ..auth.sequencer_keys import add_key, read_keys, retire_key, set_signing
from ..sequencer import ALGORITHMS, keys_to_text, to_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``credentials sequencer-key``."""
    parser.set_defaults(handler=sequencer_key_command)
    parser.add_argument("directory", metavar="DIR", help="the directory of credentials.toml")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--add", action="store_true",
                      help="add a fresh key (it signs if none does, else it only verifies until --sign)")
    what.add_argument("--sign", metavar="ID", help="make key ID the signing key (the others keep verifying)")
    what.add_argument("--retire", metavar="ID", help="remove key ID (not the signing key)")
    what.add_argument("--public", action="store_true",
                      help="print the Ed25519 public keys for resources (fastlock.sequencer.keys_from_text)")
    what.add_argument("--hmac-secret", metavar="ID",
                      help="print HMAC key ID for a resource that verifies with the shared secret")
    parser.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="ed25519",
                        help="the algorithm of an --add'ed key (default ed25519)")


def sequencer_key_command(args: argparse.Namespace) -> int:
    """Run ``credentials sequencer-key``: with no action, list the keys (id, algorithm, role)."""
    path = os.path.join(args.directory, "credentials.toml")
    if args.add:
        key = add_key(path, args.algorithm)
        print(f"added {key.algorithm} sequencer key {key.key_id.hex()} to {path}; copy the file to every node")
    elif args.sign:
        set_signing(path, args.sign)
        print(f"sequencer key {args.sign} signs from the next start of each node with {path}")
    elif args.retire:
        retire_key(path, args.retire)
        print(f"retired sequencer key {args.retire} from {path}")
    elif args.public:
        print(keys_to_text(k for k in read_keys(path).verify_keys if k.algorithm == "ed25519"), end="")
    elif args.hmac_secret:
        keys = [k for k in read_keys(path).verify_keys if k.key_id.hex() == args.hmac_secret]
        if not keys or keys[0].algorithm != "hmac-sha256":
            raise ValueError(f"no HMAC sequencer key {args.hmac_secret} in {path}")
        print(f"fastlock-sequencer-key hmac-sha256 {keys[0].key_id.hex()} {to_text(keys[0].key)}")
    else:
        current = read_keys(path)
        for key in current.keys:
            role = "signs" if current.signing is not None and key.key_id == current.signing.key_id else "verifies"
            print(f"{key.key_id.hex()} {key.algorithm} {role}")
    return 0
