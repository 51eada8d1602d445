"""Measured wire bytes (issue 21 item 6): ``benchmarks/wire_bytes.py`` runs a small quickstart
with TLS and tokens, its client connections through the counting relay, and the TCP payload it
counts per direction is at least what the ledger counted as protobuf, by a framing overhead
within a stated bound."""

from __future__ import annotations


from conftest import REPO, load_script

# TLS records (about 22 bytes per record of up to 16 KiB), HTTP/2 frames (9 bytes per frame,
# HEADERS of about a hundred bytes per call), gRPC's 5-byte message prefix, the TLS handshake and
# keepalive PINGs: a few percent on a run whose bytes are mostly tensors (measured about 1.01).
RATIO_BOUND = 1.25


def test_the_relay_counts_at_least_the_ledger_and_a_bounded_overhead(tmp_path) -> None:
    wire_bytes = load_script(REPO / "benchmarks" / "wire_bytes.py")
    config = wire_bytes.quickstart_config("fedavg", rounds=1, clients=5, processes=2)
    config["evaluate"]["finetune_epochs"] = [1]
    measured = wire_bytes.measure(config, tmp_path / "fedavg", tls=True, timeout=300.0)
    assert measured.connections >= 2
    for direction in ("down", "up"):
        assert measured.physical[direction] > 100_000, "the run moved the model both ways"
        assert measured.physical[direction] <= measured.wire[direction] <= RATIO_BOUND * measured.physical[direction]
    table = wire_bytes.format_table([measured])
    print(table)
    assert f"{measured.wire['down']:,}" in table and f"{measured.ratio('up'):.4f}" in table
