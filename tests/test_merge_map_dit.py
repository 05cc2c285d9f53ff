"""ToMA Merge Map and live stats on a DiT: Flux's double and single block groups share one token grid."""
import pytest
import torch

from toma_bench import comfy_host, models, sampling



pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

LATENT = (26, 38)  # 832x1216 / 4: a 13x19 token grid with patch size 2


def test_flux_merge_map_and_stats_show_both_block_groups(pack, sent):
    patched = pack.nodes.toma_nodes.ToMAPatchModel().patch(models.build_flux(seed=1), 0.5, 4, 5, unique_id="9")[0]
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 16, 0, None)

    samples = sampling.sample(patched, conditioning, torch.zeros(1, 16, *LATENT), steps=2, scheduler="simple")

    mm = pack.nodes.merge_map
    runtime = pack.nodes.runtime.runtime_of(patched)
    levels = runtime.report().levels
    assert [level.label for level in mm.merged_levels(levels)] == ["two-stream 13x19", "joint 13x19"]
    for level, name in enumerate(mm.merged_levels(levels)):
        image, = mm.ToMAMergeMap().draw(patched, {"samples": samples}, level, -1)
        assert image.shape == (1, 8 * LATENT[0], 8 * LATENT[1], 3)
        assert torch.equal(image[0], mm.render_record(levels[name].records[-1], 8 * LATENT[0], 8 * LATENT[1]))
    assert len(sent) == 1 and sent[0][1]["node"] == "9"
    assert [line.split(":")[0] for line in sent[0][1]["lines"][:2]] == ["two-stream 13x19", "joint 13x19"]
