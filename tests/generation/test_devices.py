"""Generation on a GPU's code path, checked on the CPU: the model on the stand-in device
(``tests/stand_in_device.py``: real values, ``.device`` not the CPU, so no fused CPU kernel and every
host step behind a ``.cpu()``) mixes no CPU tensor into its device tensors and returns what the CPU
returns: greedy, sampled (the draws come from a CPU generator wherever the model runs), sub-models,
MTP speculation, prompts holding images, clips and audio, images (NFSP) and speech (NCP)."""

from __future__ import annotations

import copy

import torch

from ernie5.fast import apply_fast_paths
from ernie5.generation.audio import AudioSampling, generate_audio, speech_prompt
from ernie5.generation.text import generate, speculative_generate
from ernie5.generation.vision import generate_media
from ernie5.model.model import Ernie5Model
from ernie5.sequence.audio import understanding_segment
from ernie5.sequence.segments import text_segment
from ernie5.sequence.vision import encode_media
from ernie5.sequence.vision import understanding_segment as vision_understanding
from ernie5.subnets.spec import resolve
from tests.conftest import micro_multimodal_parts, tiny_config
from tests.stand_in_device import stand_in_device


def test_the_stand_in_device_reports_a_cpu_tensor_mixed_in_and_keeps_values():
    with stand_in_device() as mixed:
        x = torch.arange(3.0, device="meta")
        assert x.device.type == "meta" and not x.is_cpu
        assert (x + torch.tensor(1.0)).tolist() == [1.0, 2.0, 3.0]  # a 0-dim CPU tensor: as on CUDA
        assert x[torch.tensor([2, 0])].cpu().tolist() == [2.0, 0.0]  # CPU indices: as on CUDA
        assert mixed == []
        x + torch.ones(3)  # CUDA refuses this
    assert len(mixed) == 1 and "aten.add.Tensor" in mixed[0] and "test_devices.py" in mixed[0]


def _peaked(model: Ernie5Model, scale: float) -> Ernie5Model:
    with torch.no_grad():
        model.head.weight.mul_(scale)  # no near-ties between the CPU's fused path and the device's eager one
    return model


def test_text_generation_on_the_device_path_equals_the_cpu_and_mixes_nothing():
    torch.manual_seed(0)
    cpu = _peaked(apply_fast_paths(Ernie5Model(tiny_config()).eval()), 20)
    sub = resolve("d0.5-w0.5-k1", cpu.cfg)
    prompts = [[1, 5, 7, 9], [3, 4]]

    def run(m):
        return (
            generate(m, prompts, 12),
            generate(m, prompts, 12, subnet=sub),
            generate(m, prompts, 12, temperature=1.0, seed=5),
            speculative_generate(m, prompts[0], 12)[0],
        )

    want = run(cpu)
    with stand_in_device() as mixed:
        dev = copy.deepcopy(cpu).to("meta")
        assert dev.tok_emb.weight.device.type == "meta"
        got = run(dev)
    assert mixed == []
    assert got == want


def test_media_generation_on_the_device_path_equals_the_cpu_and_mixes_nothing():
    model, _, vtok, _ = micro_multimodal_parts()
    cpu = _peaked(apply_fast_paths(model.eval()), 3)
    cfg = cpu.cfg
    torch.manual_seed(1)
    media = []
    for frames in (1, 2):  # an image and a clip
        size = cfg.vision.image_size
        enc = encode_media(vtok, torch.rand(1, 3, frames, size, size) * 2 - 1, codes=False)
        media.append(vision_understanding(cfg.vision, enc.pixels[0], enc.cnn[0]))
    doc_image = [text_segment([1, 5]), media[0], text_segment([7]), media[1], text_segment([9])]
    codes = torch.randint(0, cfg.audio.codebook_size, (6, cfg.audio.n_levels))
    doc_audio = [text_segment([1, 5]), understanding_segment(codes), text_segment([7, 9])]
    speech = [speech_prompt([text_segment([1, 5, 7])], cfg.audio.n_levels)]

    sampling = AudioSampling(temperature=1.0, max_frames=4, seed=4)

    def run(m):
        return (
            generate(m, [doc_image, doc_audio], 6, temperature=1.0, seed=3),
            generate_media(m, vtok, [[1, 5, 7]], cfg_scale=3.0, seed=2),
            [c.tolist() for c in generate_audio(m, speech, sampling)],
        )

    want = run(cpu)
    with stand_in_device() as mixed:
        got = run(copy.deepcopy(cpu).to("meta"))
    assert mixed == []
    assert got[0] == want[0] and got[2] == want[2]
    assert (got[1] == want[1]).all()
