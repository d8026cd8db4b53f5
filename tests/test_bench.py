import json

from train.bench import main

KEYS = {
    "device",
    "profile",
    "mc_step_ms",
    "plain_step_ms",
    "ratio_mc_over_plain",
    "phases",
    "compile_s",
    "graph_breaks",
    "recompiles",
    "peak_mem_mb",
    "tokens_per_s",
    "saved_activations_mb",
}
PHASES = {"tree_ms", "variants_ms", "assemble_ms", "base_ms", "losses_ms", "lens_fwd_ms", "lens_loss_ms"}


def test_bench_reports_every_key_and_a_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    tiny = [
        "--set",
        "model.n_layer=1",
        "--set",
        "model.n_embd=32",
        "--set",
        "data.vocab_size=300",
        "--set",
        "data.seq_len=64",
        "--set",
        "mc.block_size=4",
        "--set",
        "mc.budget=32",
        "--set",
        "mc.tail=8",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.device='cpu'",
    ]
    assert main(["--profile", "cpu-tiny", "--eager", "--steps", "2", "--warmup", "1", "--json", str(out), *tiny]) == 0
    result = json.loads(out.read_text())
    assert KEYS <= result.keys() and set(result["phases"]) == PHASES
    assert result["profile"] == "cpu-tiny" and result["compiled"] is False
    assert result["ratio_mc_over_plain"] == result["mc_step_ms"] / result["plain_step_ms"] > 0
    assert result["graph_breaks"] == 0 and result["recompiles"] == 0
    assert result["saved_activations_mb"] > 0 and result["activation_checkpointing"] is False
    assert result["shapes"]["V"] == 3 and result["supervised_entries"] <= 2 * 3 * 32
    assert "ratio MC / plain" in capsys.readouterr().out


def test_bench_rejects_a_bad_profile(capsys):
    assert main(["--profile", "cpu-tiny", "--set", "mc.budget=1"]) == 2
    assert "mc.budget" in capsys.readouterr().err
