"""Audio in the backbone: summed level embeddings, Next-Codec Prediction (teacher forcing and sampling)."""

from __future__ import annotations

import pytest
import torch

from ernie5.generation.audio import AudioSampling, generate_audio, speech_prompt
from ernie5.generation.text import generate
from ernie5.model.audio import END_TARGET
from ernie5.model.config import AudioConfig
from ernie5.model.elastic import Subnet
from ernie5.model.inputs import IGNORE, AudioInputs, Inputs
from ernie5.model.model import Ernie5Model
from ernie5.sequence.segments import AudioSeg, Segment, pack, text_segment
from ernie5.subnets.extract import extract_subnet
from ernie5.subnets.params import count_params
from ernie5.subnets.spec import SubnetSpec, resolve
from ernie5.tokenizers.special import BOA, BOS, EOA
from tests.conftest import tiny_config

Q, K = 3, 16
ACFG = AudioConfig(enabled=True, n_levels=Q, codebook_size=K, n_speakers=4)


def _model(**kw) -> Ernie5Model:
    torch.manual_seed(0)
    return Ernie5Model(tiny_config(max_seq_len=256, audio=ACFG, **kw)).eval()


def _codes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, K, (n, Q), generator=torch.Generator().manual_seed(seed))


def _tts_doc(codes: torch.Tensor, speaker: int = 1) -> list[Segment]:
    return [
        text_segment([BOS, 11, 12, 13], loss=False),
        text_segment([BOA], loss=False),
        Segment("audio", audio=AudioSeg(codes, start=True, speaker=speaker, targets=True)),
        text_segment([EOA]),
    ]


def _fwd(model, batch, **kw):
    return model(batch.inputs, targets=batch.targets, **kw)


def test_config_checks_and_more_levels_than_layers():
    # an extracted shallow subnet may have fewer layers than levels (heads stack on its first layer)
    assert tiny_config(audio=AudioConfig(enabled=True, n_levels=5)).audio.n_levels == 5
    with pytest.raises(ValueError, match="level_weights"):
        AudioConfig(n_levels=2, level_weights=(1.0,))


def test_packing_lays_out_start_frames_and_next_frame_targets():
    codes = _codes(4)
    batch = pack([_tts_doc(codes, speaker=2)], 16)
    a = batch.inputs.audio
    # BOS + 3 prompt ids + BOA = 5 text positions, then start + 4 frames, then EOA
    assert a.start_mask_BT[0].nonzero().flatten().tolist() == [5]
    assert a.frame_mask_BT[0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert a.start_speaker_S.tolist() == [2]
    assert torch.equal(a.frame_codes_MQ, codes)
    assert a.pred_mask_BT[0].nonzero().flatten().tolist() == [5, 6, 7, 8, 9]
    assert torch.equal(a.targets_PQ[:4], codes)  # start -> frame 1, frame j -> frame j+1
    assert a.targets_PQ[4].tolist() == [END_TARGET, IGNORE, IGNORE]  # the last frame predicts END
    assert END_TARGET == -2
    tgt = batch.targets.ids_BT
    assert tgt[0, 9] == EOA and tgt[0, 4] == IGNORE  # text loss only on text targets
    assert int(batch.modality[0, 6]) == 3


def test_ncp_teacher_forced_loss_falls_when_overfitting():
    model = _model().train()
    batch = pack([_tts_doc(_codes(6, s), speaker=s % 4) for s in range(3)], 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        out = _fwd(model, batch)
        loss = out.losses.audio + out.losses.text
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(out.losses.audio.detach()))
    assert len(out.losses.audio_levels) == Q
    assert losses[-1] < 0.3 * losses[0]


def test_level_heads_see_earlier_levels_of_the_same_frame_only():
    model = _model()
    codes = _codes(5)
    base = _fwd(model, pack([_tts_doc(codes)], 16))
    # Changing level 2 of frame 3 changes the level-3 logits where frame 3 is predicted (position of
    # frame 2) but not the level-1 and level-2 logits there, nor anything predicted before.
    changed = codes.clone()
    changed[2, 1] = (changed[2, 1] + 1) % K
    alt = _fwd(model, pack([_tts_doc(changed)], 16))
    p = 2  # prediction rows: start, f1, f2 (predicts frame 3), ...
    for level in (0, 1):
        assert torch.allclose(base.audio_logits[level][: p + 1], alt.audio_logits[level][: p + 1], atol=1e-6)
    assert not torch.allclose(base.audio_logits[2][p], alt.audio_logits[2][p])
    assert torch.allclose(base.audio_logits[2][:p], alt.audio_logits[2][:p], atol=1e-6)


def test_inference_yields_every_level_of_a_frame_in_one_forward_and_matches_teacher_forcing():
    model = _model()
    doc = speech_prompt([text_segment([BOS, 11, 12, 13], loss=False)], Q, speaker=1)
    batch = pack([doc], 8)
    a = batch.inputs.audio
    pred = torch.zeros_like(batch.inputs.doc_ids_BT, dtype=torch.bool)
    pred[0, 5] = True
    calls = []

    def greedy(level, logits):
        calls.append(level)
        return logits[:, :K].argmax(-1)

    audio = AudioInputs(None, None, a.start_speaker_S, a.start_mask_BT, None, pred)
    inputs = Inputs(
        batch.inputs.ids_BT,
        positions_3BT=batch.inputs.positions_3BT,
        doc_ids_BT=batch.inputs.doc_ids_BT,
        block_ids_BT=batch.inputs.block_ids_BT,
        audio=audio,
    )
    out = model(inputs, audio_sampler=greedy)
    assert calls == list(range(Q)) and out.audio_codes_PQ.shape == (1, Q)
    # Teacher forcing with the sampled codes as targets gives the same logits at that position.
    tf = _fwd(model, pack([_tts_doc(out.audio_codes_PQ)], 16))
    for level in range(Q):
        assert torch.allclose(tf.audio_logits[level][0], out.audio_logits[level][0], atol=1e-5)


def test_cached_generation_equals_teacher_forced_argmax():
    model = _model()
    prompt = [text_segment([BOS, 11, 12, 13], loss=False)]
    sampling = AudioSampling(max_frames=6, min_frames=6)
    (codes,) = generate_audio(model, [speech_prompt(prompt, Q, speaker=1)], sampling)
    assert codes.shape == (6, Q)
    # Re-run the whole sequence teacher-forced: the argmax at every prediction row is the sampled code.
    tf = _fwd(model, pack([_tts_doc(codes)], 16))
    for level in range(Q):
        am = tf.audio_logits[level][:6, :K].argmax(-1)
        assert torch.equal(am, codes[:, level]), level


def test_batched_generation_matches_one_row_at_a_time_and_stops_at_end():
    model = _model()
    prompts = [
        speech_prompt([text_segment([BOS, 11], loss=False)], Q, speaker=0),
        speech_prompt([text_segment([BOS, 11, 12, 13, 14], loss=False)], Q, speaker=3),
    ]
    sampling = AudioSampling(max_frames=5, temperature=0.8, seed=3)
    greedy = AudioSampling(max_frames=5)
    both = generate_audio(model, prompts, greedy)
    for p, c in zip(prompts, both, strict=True):
        assert torch.equal(generate_audio(model, [p], greedy)[0], c)
    assert all(c.shape[1] == Q and len(c) <= 5 for c in generate_audio(model, prompts, sampling))
    # a level-1 head that always says END: no frames once END is allowed, exactly min_frames otherwise
    head = torch.nn.Linear(model.cfg.d_model, K + 1)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[ACFG.end_code] = 10.0
    model.audio.heads[0] = head
    assert all(len(c) == 0 for c in generate_audio(model, prompts, AudioSampling(max_frames=5, min_frames=0)))
    assert all(len(c) == 2 for c in generate_audio(model, prompts, AudioSampling(max_frames=5, min_frames=2)))


def test_speech_prompt_is_required():
    model = _model()
    with pytest.raises(ValueError, match="audio start position"):
        generate_audio(model, [[text_segment([BOS, 11])]])
    with pytest.raises(ValueError, match="no audio module"):
        generate_audio(Ernie5Model(tiny_config()), [speech_prompt([text_segment([BOS])], Q)])


def test_audio_understanding_prompt_generates_text():
    model = _model()
    und = Segment("audio", audio=AudioSeg(_codes(7)))
    doc = [text_segment([BOS, BOA]), und, text_segment([EOA, 20, 21])]
    new = generate(model, [doc, [BOS, 30]], 4)
    assert len(new) == 2 and all(len(n) == 4 for n in new)
    # the document prompt gives the same continuation alone as in a batch
    assert generate(model, [doc], 4)[0] == new[0]


def test_shallow_subnets_stack_levels_and_extraction_keeps_the_audio_module():
    model = _model()
    batch = pack([_tts_doc(_codes(4))], 16)
    for depth in (1, 2):
        sub = resolve(SubnetSpec(depth=depth), model.cfg)
        plan = model.audio.level_layers(sub.layers)
        assert sorted(lv for lvs in plan.values() for lv in lvs) == list(range(Q))
        assert plan[sub.layers[0]][0] == 0 and plan[sub.layers[-1]][-1] == Q - 1
        out = _fwd(model, batch, subnet=sub)
        assert len(out.losses.audio_levels) == Q and torch.isfinite(out.losses.audio)
        (codes,) = generate_audio(
            model, [speech_prompt([text_segment([BOS])], Q)], AudioSampling(max_frames=3), subnet=sub
        )
        assert codes.shape[1] == Q
    for spec in (SubnetSpec(depth=3, width=0.5, top_k=1), SubnetSpec(depth=2)):
        sub = resolve(spec, model.cfg)
        child = extract_subnet(model, sub)
        a, b = _fwd(model, batch, subnet=sub), _fwd(child, batch, subnet=Subnet.full(child.cfg))
        assert torch.allclose(a.losses.audio, b.losses.audio, atol=1e-5)


def test_audio_parameters_are_counted_in_total_but_not_active():
    with_audio = count_params(tiny_config(audio=ACFG))
    without = count_params(tiny_config())
    n_audio = sum(p.numel() for p in _model().audio.parameters())
    assert with_audio.total_params - without.total_params == n_audio
    assert with_audio.active_params == without.active_params
