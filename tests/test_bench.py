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
        "--device",
        "cpu",
    ]
    assert main(["--profile", "cpu-long", "--eager", "--steps", "2", "--warmup", "1", "--json", str(out), *tiny]) == 0
    result = json.loads(out.read_text())
    assert KEYS <= result.keys() and set(result["phases"]) == PHASES
    assert result["profile"] == "cpu-long" and result["compiled"] is False
    assert result["ratio_mc_over_plain"] == result["mc_step_ms"] / result["plain_step_ms"] > 0
    assert result["graph_breaks"] == 0 and result["recompiles"] == 0
    assert result["saved_activations_mb"] > 0
    assert result["shapes"]["V"] == 3 and result["supervised_entries"] <= 2 * 3 * 32
    assert "ratio MC / plain" in capsys.readouterr().out


def test_bench_rejects_a_bad_profile(capsys):
    assert main(["--profile", "cpu-long", "--set", "mc.budget=1"]) == 2
    assert "mc.budget" in capsys.readouterr().err


def test_decode_bench_times_every_mode_at_every_length(tmp_path, decoding_run, capsys):
    """``--decode``: one row per prompt length with each mode's tokens/s, the MC/full ratio and the share of
    cache entries warm refocuses kept (cold ones keep none, the prefix no more than the moved entries); a refill
    chunk of the caller's; bad requests exit 2."""
    run, prompt = decoding_run
    out = tmp_path / "decode.json"
    common = [
        "--decode",
        str(run),
        "--prompt-file",
        str(prompt),
        "--new-tokens",
        "9",
        "--refocus-every",
        "4",
        "--eager",
    ]
    assert main([*common, "--lengths", "20,120", "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in rows] == [20, 120]
    for r in rows:
        assert min(r["mc_tok_s"], r["mc_cold_tok_s"], r["full_tok_s"]) > 0
        assert r["mc_over_full"] == r["mc_tok_s"] / r["full_tok_s"]
        assert r["mc_cold_cache_kept"] == 0 and 0 <= r["mc_cache_kept"] < 1
        assert r["mc_cache_kept"] >= r["mc_prefix_cache_kept"]  # the moved entries kept besides the prefix
        assert r["mc_prefix_refocus_ms_per_refocus"] >= r["mc_prefix_focus_ms_per_refocus"] > 0
    assert "| 120 |" in capsys.readouterr().out
    assert all(r["mc_refocus_ms_per_refocus"] >= r["mc_focus_ms_per_refocus"] > 0 for r in rows)
    assert all(r["mc_refocus_ops"] > 0 for r in rows)
    assert main([*common, "--lengths", "20", "--modes", "mc,full", "--json", str(out)]) == 0  # the GPU check's pair
    (row,) = json.loads(out.read_text())
    assert "mc_cold_tok_s" not in row and "recency_tok_s" not in row and row["mc_over_full"] > 0
    assert "MC / full" in capsys.readouterr().out
    assert main([*common, "--lengths", "20", "--modes", "mc", "--refill-chunk", "3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["mc_tok_s"] > 0
    assert main([*common, "--lengths", "20", "--refill-chunk", "0"]) == 2
    assert main([*common, "--lengths", "20", "--modes", "mc,warm"]) == 2  # no such mode
    assert main([*common, "--lengths", "100000"]) == 2  # longer than the prompt file
    assert main(["--decode", str(run), "--lengths", "20"]) == 2  # no prompt
    assert main([*common, "--lengths", "20,x"]) == 2
