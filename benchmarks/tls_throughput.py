"""TLS against plain TCP: push and pop at -P 64, on one server each, in interleaved rounds.

    python benchmarks/tls_throughput.py                 # 5 rounds of 200,000 ops per scenario
    python benchmarks/tls_throughput.py --rounds 3 -n 100000

Each round starts a fresh plain ``pinpriq-server`` and a fresh one with ``--tls-cert`` and
``--tls-key`` (a throwaway CA and certificate from trustme), runs ``pinpriq-bench -c 4 -P 64``
(8-byte keys, 16-byte payloads, as ``compare_redis.py``) on each, one after the other, and
takes the ratio TLS / plain of ops per second. It prints each round and the median ratio per
scenario: interleaving makes a burst of load from elsewhere hit both sides of a ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import trustme

BIN = Path(sys.executable).parent
LISTENING = re.compile(r"listening on \S+ port (\d+)")
WORKLOAD = ["-c", "4", "-P", "64", "--key-size", "8", "--payload-size", "16"]


def rate(scenario: str, ops: int, tls: list[str], bench_tls: list[str]) -> float:
    """Ops per second of one scenario on a fresh server."""
    server = subprocess.Popen(
        [str(BIN / "pinpriq-server"), "--port", "0", "--http-port", "off", *tls],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stderr is not None
        match = LISTENING.search(server.stderr.readline())
        assert match, "the server did not say where it listens"
        command = [str(BIN / "pinpriq-bench"), "--port", match.group(1), "-q", "--json"]
        done = subprocess.run(
            [*command, "-t", scenario, "-n", str(ops), *WORKLOAD, *bench_tls],
            capture_output=True,
            text=True,
            check=True,
            timeout=1800,
        )
        (result,) = json.loads(done.stdout)["results"]
        return float(result["ops_per_sec"])
    finally:
        server.kill()
        server.communicate(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-n", dest="ops", type=int, default=200_000)
    parser.add_argument("-t", dest="scenarios", default="push,pop")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        files = Path(directory)
        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1")
        leaf.private_key_and_cert_chain_pem.write_to_path(files / "cert.pem")
        leaf.private_key_pem.write_to_path(files / "key.pem")
        ca.cert_pem.write_to_path(files / "ca.pem")
        tls = ["--tls-cert", str(files / "cert.pem"), "--tls-key", str(files / "key.pem")]
        bench_tls = ["--tls-ca", str(files / "ca.pem")]
        for scenario in args.scenarios.split(","):
            ratios = []
            for number in range(1, args.rounds + 1):
                plain = rate(scenario, args.ops, [], [])
                secure = rate(scenario, args.ops, tls, bench_tls)
                ratios.append(secure / plain)
                print(
                    f"{scenario} -P 64 round {number}: plain {plain:,.0f} ops/s, TLS "
                    f"{secure:,.0f} ops/s, TLS / plain {ratios[-1]:.2f}",
                    flush=True,
                )
            print(f"{scenario} -P 64: median TLS / plain {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
