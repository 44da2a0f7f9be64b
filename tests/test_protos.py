"""Generated stubs are fresh, and the public contract names other code and clients rely on exist."""

from pathlib import Path

from service_kit.protogen import PROTO_ROOT, generate


def test_stubs_match_the_protos(tmp_path: Path):
    fresh = generate(out_dir=tmp_path)
    assert fresh, "protoc produced nothing"
    for f in fresh:
        installed = PROTO_ROOT / f.relative_to(tmp_path)
        assert installed.exists(), f"{installed} missing: run `make protos`"
        assert installed.read_bytes() == f.read_bytes(), f"{installed} is stale: run `make protos`"


def test_public_contract_names():
    from ddtree.v1 import generation_pb2 as pb

    svc = pb.DESCRIPTOR.services_by_name["Generation"]
    assert {m.name for m in svc.methods} >= {"Generate", "Tokenize", "GetServerInfo"}
    assert svc.methods_by_name["Generate"].server_streaming
    fields = lambda msg: set(msg.DESCRIPTOR.fields_by_name)  # noqa: E731
    assert fields(pb.GenerateRequest) >= {"request_id", "text", "token_ids", "chat", "sampling", "stopping",
                                          "speculation", "return_logprobs"}
    assert [o.name for o in pb.GenerateRequest.DESCRIPTOR.oneofs] == ["input"]
    assert fields(pb.SamplingParams) >= {"temperature", "top_p", "top_k", "seed"}
    assert all(pb.SamplingParams.DESCRIPTOR.fields_by_name[f].has_presence for f in ("temperature", "top_p", "top_k", "seed"))
    assert fields(pb.StoppingCriteria) >= {"max_new_tokens", "stop", "stop_token_ids", "ignore_eos"}
    assert fields(pb.SpeculationParams) >= {"mode", "tree_budget"}
    assert set(pb.SpecMode.keys()) >= {"SPEC_MODE_UNSPECIFIED", "SPEC_MODE_AR", "SPEC_MODE_CHAIN", "SPEC_MODE_DDTREE"}
    assert fields(pb.Chunk) >= {"token_ids", "text", "logprobs"}
    assert fields(pb.Final) >= {"finish_reason", "matched_stop", "usage", "spec_stats"}
    assert fields(pb.Usage) >= {"prompt_tokens", "completion_tokens"}
    assert fields(pb.SpecStats) >= {"verify_steps", "accepted_draft_tokens", "mean_acceptance_length", "tree_budget"}
    assert set(pb.FinishReason.keys()) >= {"FINISH_REASON_UNSPECIFIED", "FINISH_REASON_LENGTH", "FINISH_REASON_STOP",
                                           "FINISH_REASON_EOS", "FINISH_REASON_CANCELLED"}


def test_every_rpc_and_field_is_documented():
    """Each rpc and field line in the .proto files is preceded by a comment (or is self-evident in a
    documented message of one-word fields listed in its comment)."""
    undocumented = []
    for proto in PROTO_ROOT.rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            if s.startswith("rpc ") and not lines[i - 1].strip().startswith("//"):
                undocumented.append(f"{proto.name}:{i + 1}: {s}")
    assert not undocumented, "\n".join(undocumented)
