"""``benchmarks/transport_cost.py`` end to end on a small load: every transport's receiver and
senders start as processes of their own, the uploads complete over mutual TLS with certificates
made in the run, and the table has a row per transport with the CPU of each side."""

from __future__ import annotations

import re

import pytest

from conftest import REPO, load_script

transport_cost = load_script(REPO / "benchmarks" / "transport_cost.py")


def test_every_transport_completes_uploads_and_reports_their_cpu(capsys) -> None:
    code = transport_cost.main(["--senders", "1", "--bytes", "300000", "--rate", "20", "--seconds", "1.5",
                                "--warmup", "0.5", "--repeat", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] and line.split()[0] in
            transport_cost.TRANSPORTS}
    assert sorted(rows) == sorted(transport_cost.TRANSPORTS)
    for transport, row in rows.items():
        uploads = int(re.search(r"; (\d+)$", row).group(1))
        assert uploads >= 5, row  # 20 a second asked for, over 1.5 s
        receiver, senders, total = (float(x) for x in row.split()[1:4])
        assert total == pytest.approx(receiver + senders, abs=0.02)
    assert rows["grpc-aio"].split()[4] == "1.00"


def test_bad_options_are_refused_before_anything_starts(capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        transport_cost.main(["--transports", "grpc-aio,carrier-pigeon"])
    assert refused.value.code == 2
    assert "carrier-pigeon" in capsys.readouterr().err
