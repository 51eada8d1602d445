"""The load generator of ``benchmarks/server_scale.py`` through the fault relay (issue 20):
connections reset at seeded random bytes of the rounds' and of the final evaluation's traffic cost
streams sent again, never a result, an evaluation, or a wait on a timeout. Real processes on
127.0.0.1: a ``fedpart server``, the relay (``python -m lab.relay``) and one load
generator with 40 virtual client processes."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REPO, load_script

SCRIPT = REPO / "benchmarks" / "server_scale.py"
# The server's round and evaluation timeouts: a task or an evaluation lost for good would hold its
# round or the evaluation this long, and the run would then miss it.
TIMEOUT = 60.0
CUTS, EVALUATION_CUTS = 4, 3
server_scale = load_script(SCRIPT)


def test_resets_in_the_rounds_and_the_evaluation_lose_nothing_and_wait_on_no_timeout(tmp_path: Path) -> None:
    args = server_scale.parse_args(server_scale.build_parser(), [
        "--rows", "200x40", "--rounds", "2", "--fraction", "0.2", "--model", "mlp", "--generators", "1",
        "--timeout", str(TIMEOUT), "--cuts", str(CUTS), "--evaluation-cuts", str(EVALUATION_CUTS),
        "--fault-seed", "0"])
    row = args.rows[0]
    model_bytes = sum(t.numel() * t.element_size() for t in server_scale.result_tensors("mlp").values())
    result = server_scale.run_row(row, args, tmp_path, model_bytes)

    assert result.problems == [], result.problems
    assert result.relay["resets"] == result.planned_cuts == CUTS + EVALUATION_CUTS, result.relay
    assert result.results_per_round == result.sampled_per_round == [40, 40]
    assert result.evaluated == row.clients
    assert result.load["failures"] == []
    # the cuts hit the rounds and the evaluation: what they cut was sent again, nothing was given up
    delivery = [*result.delivery_per_round, result.evaluation_delivery]
    assert all(counts.given_up == 0 for counts in delivery), delivery
    resent = [counts.tasks_sent_again + counts.results_sent_again + counts.streams_cut for counts in delivery]
    assert sum(resent[:-1]) >= 1 and resent[-1] >= 1, delivery
    # and nothing waited on a timeout: each round and the evaluation ended far within it
    assert max(result.round_seconds) < TIMEOUT / 2, result.round_seconds
    assert result.evaluation_seconds is not None and result.evaluation_seconds < TIMEOUT / 2

    # the offsets were planned on the traffic the run had: its tensor bytes, plus a part and a whole
    # task or result again for each cut, and the headers (1 %)
    config = server_scale.scale_config(row.clients, args.rounds, args.fraction, args.model, TIMEOUT)
    planned_rounds, planned_evaluation = server_scale.expected_traffic(row, config, model_bytes)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds_bytes = sum(r["bytes_down"] + r["bytes_up"] for r in records)
    evaluation = json.loads((tmp_path / "run" / "summary.json").read_text())["bytes"]["evaluation"]
    for planned, cuts, measured in [(planned_rounds, CUTS, rounds_bytes),
                                    (planned_evaluation, EVALUATION_CUTS, evaluation["down"] + evaluation["up"])]:
        assert planned <= measured <= 1.01 * planned + 2 * cuts * model_bytes, (planned, measured)
