import json

import pytest

from tokenflow_ray.cli import build_parser, main


def test_tokenizer_group_has_experiment_and_bench():
    parser = build_parser()
    args = parser.parse_args(["tokenizer", "bench", "--json", "x.json"])
    assert callable(args.handler) and args.codebook_size == 32768
    args = parser.parse_args(["tokenizer", "experiment", "--json", "x.json", "--plots", "d", "--quick"])
    assert args.quick and args.seeds is None


def test_bad_values_fail_cleanly(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["tokenizer", "experiment", "--json", "x.json", "--plots", "d", "--seeds", "0"])
    assert main(["tokenizer", "bench", "--json", str(tmp_path / "missing" / "b.json"), "--codebook-size", "64",
                 "--tokens", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_small_agrees_with_naive(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["tokenizer", "bench", "--json", str(out), "--codebook-size", "2048", "--tokens", "512"]) == 0
    result = json.loads(out.read_text())
    assert result["index_agreement"] == 1.0
    assert result["quantizer_ratio_vs_naive"] > 0
    assert result["chunked_block_bound_mib"] <= 4.0
    assert "train_images_s" not in result  # added by the training pipeline, never faked here


def test_quick_experiment_writes_json_table_and_plots(tmp_path, monkeypatch):
    from dataclasses import replace

    from tokenflow_ray.tokenizer.experiment import run

    # The command's whole path at a few steps: this checks the JSON, table and plots, not what training reaches
    # (the recorded runs in docs/results/tokenizer.md do), and --quick's 30 steps an arm took ~2 minutes of the suite.
    monkeypatch.setattr(run, "QUICK", replace(run.QUICK, steps=4, teacher_steps=8))
    out, plots = tmp_path / "exp.json", tmp_path / "plots"
    assert main(["tokenizer", "experiment", "--json", str(out), "--plots", str(plots), "--quick"]) == 0
    result = json.loads(out.read_text())
    for arm in ("P", "S", "TF", "TF-sep"):
        assert {"psnr", "digit_acc", "color_acc", "usage"} <= set(result["arms"][arm])
        assert 0 <= result["arms"][arm]["digit_acc"] <= 1
    assert result["arms"]["TF-sep"]["tokens_per_image"] == 2 * result["arms"]["TF"]["tokens_per_image"]
    assert {"0", "1", "inf", "3"} <= set(result["w_sweep"])
    assert (plots / "accuracy_vs_psnr.png").is_file() and (plots / "usage_histogram.png").is_file()
    assert (plots / "table.md").read_text().startswith("| arm |")
