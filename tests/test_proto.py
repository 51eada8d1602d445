"""The committed generated protobuf code must match ``proto/fedpart.proto``."""

from pathlib import Path

import pytest

PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools comes with the test extra")
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate", PROTO_DIR / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    generate.generate(tmp_path)
    for name in generate.GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (PROTO_DIR / name).read_text()
        assert fresh == committed, f"proto/{name} is stale: run `python proto/generate.py` and commit the result"


def test_service_has_the_documented_rpcs() -> None:
    from fedpart.proto import fedpart_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    assert {m.name for m in service.methods} == {"Join", "GetTask", "SubmitResult", "Heartbeat", "Leave"}
    assert service.methods_by_name["GetTask"].server_streaming
    assert service.methods_by_name["SubmitResult"].client_streaming
