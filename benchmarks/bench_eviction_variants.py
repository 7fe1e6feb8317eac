"""The prototypes of ``eviction_prototypes.py`` against ``lru``, the default and the offline optimum on the same calls,
as an engine serves them: the figures behind the default's design, kept so they can be reproduced and extended.

Same traces, servings and table as ``bench_eviction.py`` (share of the gap between ``lru`` and the optimum closed, in
parentheses), with the prototypes as extra policies; a prototype is any ``EvictionPolicy`` registered by name.

    python benchmarks/bench_eviction_variants.py                                   # every prototype, every trace
    python benchmarks/bench_eviction_variants.py --traces agent,mooncake --variants dip:victims,dip:newcomers \\
        --orders round-robin --in-service 1
"""

from __future__ import annotations

import argparse
import sys

from bench_eviction import main as bench_eviction
from eviction_prototypes import PROTOTYPES, register

from mmcache.eviction import DEFAULT_POLICY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--variants", default=",".join(PROTOTYPES))
    args, rest = ap.parse_known_args()
    register()
    sys.argv = [sys.argv[0], "--policies", ",".join(["lru", DEFAULT_POLICY, *args.variants.split(",")]), *rest]
    bench_eviction()


if __name__ == "__main__":
    main()
