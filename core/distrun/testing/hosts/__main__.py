"""``python -m distrun.testing.hosts``: a testbed of namespace hosts by hand (torch-free).

    python -m distrun.testing.hosts up 2               # host0 198.18.0.1, host1 198.18.0.2
    python -m distrun.testing.hosts run 1 -- bash      # a shell on host1
    python -m distrun.testing.hosts status
    python -m distrun.testing.hosts cut 1 / restore 1 / shape 1 100mbit / unshape 1 / kill 1
    python -m distrun.testing.hosts down

The testbed stays up between commands (its name is ``--label``, "lab" by default) until
``down``. See docs/cluster.md, "Multi-node by hand".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence

from distrun.testing.hosts import HostSpec, Testbed, TestbedError, unavailable

__all__ = ["main"]

PROG = "python -m distrun.testing.hosts"


def _table(bed: Testbed) -> Iterable[str]:
    yield f"testbed {bed.id!r}: {len(bed)} hosts on one bridge (namespace {bed.switch})"
    for h in bed.hosts:
        link = h.link(0)
        second = f"  eth1 {h.address2}" if h.address2 else ""
        yield (f"  {h.index}  {h.name:<6} eth0 {h.address}{second}  link {link['switch']}  "
               f"rate {link['rate']}  processes {len(h.pids())}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Network-namespace hosts on one "
                                     "machine, joined by a bridge (needs root).")
    parser.add_argument("--label", default="lab",
                        help="the testbed's name (lowercase word; default: lab)")
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="make N hosts")
    up.add_argument("n", type=int)
    up.add_argument("--loopback-name", type=int, action="append", default=[], metavar="K",
                    help="host K's own name resolves to 127.0.1.1 in its hosts file")
    up.add_argument("--second-net", type=int, action="append", default=[], metavar="K",
                    help="host K gets eth1 on a second network, 198.19.0.0/24")
    up.add_argument("--rate", help="shape every cable, e.g. 1gbit")
    sub.add_parser("down", help="kill every process of the hosts and remove the testbed")
    sub.add_parser("status", help="hosts, addresses, links, shaping, processes")
    run = sub.add_parser("run", help="run a command on host K: run K -- CMD ...")
    run.add_argument("k", type=int)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    for verb, text in (("cut", "pull host K's cable"), ("restore", "plug it back in"),
                       ("unshape", "remove the rate limit"),
                       ("kill", "SIGKILL every process of host K (node loss)")):
        sub.add_parser(verb, help=text).add_argument("k", type=int)
    shape = sub.add_parser("shape", help="limit host K's cable to RATE (both ways)")
    shape.add_argument("k", type=int)
    shape.add_argument("rate")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.verb == "up":
        why = unavailable()
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
    try:
        if args.verb == "up":
            specs = [HostSpec(own_name="loopback" if k in args.loopback_name else "address",
                              second_net=k in args.second_net, rate=args.rate)
                     for k in range(args.n)]
            bed = Testbed.up(specs, label=args.label)
            print("\n".join(_table(bed)))
            print(f"run a command on host K with: {PROG} run K -- COMMAND")
            return 0
        bed = Testbed.attach(args.label)
        if args.verb == "down":
            bed.down()
            print(f"testbed {args.label!r} removed")
        elif args.verb == "status":
            print("\n".join(_table(bed)))
        else:
            if not 0 <= args.k < len(bed):
                print(f"error: no host {args.k} (hosts 0..{len(bed) - 1})", file=sys.stderr)
                return 2
            host = bed[args.k]
            if args.verb == "run":
                cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
                if not cmd:
                    print(f"error: give a command: {PROG} run {args.k} -- COMMAND",
                          file=sys.stderr)
                    return 2
                os.execvp("ip", host.command(cmd))
            elif args.verb == "kill":
                print(f"{host.name}: killed {len(host.kill_all())} processes")
            elif args.verb == "shape":
                host.shape(args.rate)
            else:
                getattr(host, args.verb)()
    except (TestbedError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
