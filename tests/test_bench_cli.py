"""The random-weight speed benchmarks' command lines, parsed without ComfyUI or a model."""
import pytest

from toma_bench import flux


@pytest.mark.parametrize("option, value", [("--scopes", "block,whole"), ("--scopes", ""),
                                           ("--merge-every", "0"), ("--merge-every", "101"),
                                           ("--merge-every", "1,two"), ("--ratios", "0"), ("--ratios", "0.95")])
def test_flux_rejects_bad_lists_naming_the_option(option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        flux.parse_args(["--device", "cpu", option, value])
    assert exit_info.value.code == 2  # argparse's usage error
    assert f"error: {option} must be a comma list of" in capsys.readouterr().err


def test_flux_defaults_on_cpu():
    args = flux.parse_args(["--device", "cpu"])
    assert (args.ratios, args.scopes, args.merge_every) == ([0.5, 0.75], ["block", "attention"], [1, 3])


def test_flux_variants_are_every_scope_and_schedule_at_every_ratio():
    args = flux.parse_args(["--device", "cpu", "--ratios", "0.25,0.5", "--scopes", "attention,block",
                            "--merge-every", "1,3"])
    labels = [v.label for v in flux.variants_of(args.ratios, args.scopes, args.merge_every)]
    assert labels == ["unpatched",
                      "ToMA attention r=0.25", "ToMA attention r=0.25 every 3",
                      "ToMA block r=0.25", "ToMA block r=0.25 every 3",
                      "ToMA attention r=0.5", "ToMA attention r=0.5 every 3",
                      "ToMA block r=0.5", "ToMA block r=0.5 every 3"]
    assert [v.label for v in flux.variants_of([0.75], ["block"], [2])] == ["unpatched", "ToMA block r=0.75 every 2"]


@pytest.mark.parametrize("line", ["Using pytorch attention",  # ComfyUI of 2024 and 2025
                                  "\x1b[32m[INFO]\x1b[0m Using pytorch attention"])  # ComfyUI v0.33.0's log
def test_main_job_names_comfyuis_attention_backend_from_its_log(tmp_path, line):
    from toma_bench import main_job

    log = tmp_path / "comfyui.log"
    log.write_text(f"Total VRAM 0 MB\n{line}\nUsing pytorch attention in VAE\n")
    assert main_job.attention_line(log) == "Using pytorch attention"
