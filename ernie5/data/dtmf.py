"""DTMF (touch-tone) key sequences: a procedural audio world that needs no data, with an exact decoder.

Every key of a telephone keypad is the sum of one low "row" tone and one high "column" tone::

              1209 Hz  1336 Hz  1477 Hz
    697 Hz      1        2        3
    770 Hz      4        5        6
    852 Hz      7        8        9
    941 Hz      *        0        #

:func:`dtmf_utterance` renders a key string as an :class:`~ernie5.data.audio.Utterance` (transcript
``normalize_text(keys)``: ``"4#"`` is ``"four pound"``), with random tone and gap lengths, levels, twist
(row/column level difference), phases and optional white noise, all drawn from the ``random.Random``
passed in. :func:`goertzel_decode` recovers the keys analytically, so audio generated for a DTMF prompt can
be scored exactly, without a learned judge.

References:
  - ITU-T Recommendation Q.23, "Technical features of push-button telephone sets" (the frequencies) and
    Q.24 (reception: tone duration, twist and signal-to-noise limits).
  - G. Goertzel, "An algorithm for the evaluation of finite trigonometric series", Amer. Math. Monthly,
    1958.

Deviations:
  1. Only the 12 keys of a phone keypad are generated (the fourth column, 1633 Hz, keys A-D, is not); the
     decoder still measures 1633 Hz so that an A-D tone is not misread as 3/6/9/#.
  2. Tones are 80-140 ms with 50-100 ms gaps by default (Q.24 asks receivers to accept >= 40 ms) and
     start and end with a 5 ms raised-cosine ramp, so the waveform has no clicks; an utterance starts and
     ends with a silence drawn like a gap.
  3. Level and twist vary within +-3 dB (Q.24 allows up to 8 dB of reverse twist); frequencies are exact
     (Q.23 allows +-1.8 %).
"""

from __future__ import annotations

import math
import random

import numpy as np

from ernie5.data.audio import SAMPLE_RATE, Utterance, normalize_text

DTMF_KEYS = "0123456789*#"
"""The keys :func:`dtmf_sequences` draws from (a 12-key phone keypad)."""
ROW_FREQS: tuple[float, ...] = (697.0, 770.0, 852.0, 941.0)
"""Low-group (row) frequencies, Hz."""
COL_FREQS: tuple[float, ...] = (1209.0, 1336.0, 1477.0, 1633.0)
"""High-group (column) frequencies, Hz; 1633 Hz (keys A-D) is measured by the decoder, never generated."""
KEYPAD: tuple[str, ...] = ("123A", "456B", "789C", "*0#D")
"""``KEYPAD[row][col]`` is the key of row tone ``row`` and column tone ``col``."""
KEY_FREQS: dict[str, tuple[float, float]] = {
    key: (ROW_FREQS[r], COL_FREQS[c]) for r, row in enumerate(KEYPAD) for c, key in enumerate(row)
}
"""``(row Hz, column Hz)`` of every key, including A-D."""
RAMP_S = 0.005
"""Raised-cosine fade at both ends of every tone, seconds."""


def dtmf_tone(
    key: str,
    duration_s: float,
    sample_rate: int = SAMPLE_RATE,
    amplitude: float = 0.5,
    twist_db: float = 0.0,
    phases: tuple[float, float] = (0.0, 0.0),
) -> np.ndarray:
    """The tone of one key, ``float32 (round(duration_s * sample_rate),)``.

    The row and column sinusoids have amplitudes ``a_row`` and ``a_col`` with ``a_row + a_col ==
    amplitude`` (so the peak never exceeds ``amplitude``) and ``20 log10(a_col / a_row) == twist_db``; both
    ends fade in/out over :data:`RAMP_S` (raised cosine).
    """
    if key not in KEY_FREQS:
        raise ValueError(f"not a DTMF key: {key!r} (expected one of {''.join(KEY_FREQS)})")
    f_row, f_col = KEY_FREQS[key]
    n = max(0, round(duration_s * sample_rate))
    t = np.arange(n, dtype=np.float64) / sample_rate
    ratio = 10.0 ** (twist_db / 20.0)
    a_row = amplitude / (1.0 + ratio)
    a_col = amplitude - a_row
    x = a_row * np.sin(2 * math.pi * f_row * t + phases[0]) + a_col * np.sin(
        2 * math.pi * f_col * t + phases[1]
    )
    ramp = min(round(RAMP_S * sample_rate), n // 2)
    if ramp > 0:
        fade = 0.5 - 0.5 * np.cos(math.pi * (np.arange(ramp) + 0.5) / ramp)
        x[:ramp] *= fade
        x[n - ramp :] *= fade[::-1]
    return x.astype(np.float32)


def dtmf_utterance(
    keys: str,
    rng: random.Random,
    sample_rate: int = SAMPLE_RATE,
    tone_s: tuple[float, float] = (0.08, 0.14),
    gap_s: tuple[float, float] = (0.05, 0.10),
    snr_db: float | None = 30.0,
) -> Utterance:
    """``keys`` dialled: silence, tone, gap, tone, ..., silence, as an :class:`Utterance` with text
    ``normalize_text(keys)``, speaker and source ``dtmf``, uid ``dtmf/<keys>`` (callers that need unique
    ids, such as :func:`dtmf_sequences`, set their own).

    Per key: duration ``uniform(*tone_s)``, level ``uniform(0.3, 0.6)``, twist ``uniform(-3, 3)`` dB,
    random phases; every gap (and the leading and trailing silence) is ``uniform(*gap_s)``. With
    ``snr_db`` set, white Gaussian noise is added at that SNR relative to the mean power of the tones
    over the whole utterance; the result is clipped to [-1, 1]. All randomness comes from ``rng``.
    """
    bad = [k for k in keys if k not in KEY_FREQS]
    if bad:
        raise ValueError(f"not DTMF keys: {''.join(bad)!r}")
    silence = [np.zeros(round(rng.uniform(*gap_s) * sample_rate), dtype=np.float32)]
    pieces = list(silence)
    for key in keys:
        tone = dtmf_tone(
            key,
            rng.uniform(*tone_s),
            sample_rate,
            amplitude=rng.uniform(0.3, 0.6),
            twist_db=rng.uniform(-3.0, 3.0),
            phases=(rng.uniform(0, 2 * math.pi), rng.uniform(0, 2 * math.pi)),
        )
        pieces += [tone, np.zeros(round(rng.uniform(*gap_s) * sample_rate), dtype=np.float32)]
    wave = np.concatenate(pieces)
    noise_seed = rng.getrandbits(64)
    if snr_db is not None and len(wave):
        power = float(np.mean(wave.astype(np.float64) ** 2))
        sigma = math.sqrt(power / 10.0 ** (snr_db / 10.0)) if power > 0 else 0.0
        noise = np.random.default_rng(noise_seed).standard_normal(len(wave)) * sigma
        wave = np.clip(wave + noise, -1.0, 1.0).astype(np.float32)
    return Utterance(wave, normalize_text(keys), "dtmf", "dtmf", f"dtmf/{keys}")


def dtmf_sequences(
    n: int,
    min_len: int = 2,
    max_len: int = 5,
    seed: int = 0,
    keys: str = DTMF_KEYS,
    snr_db: float | None = 30.0,
) -> list[Utterance]:
    """``n`` utterances of ``min_len..max_len`` keys drawn uniformly (with repeats) from ``keys``, rendered
    by :func:`dtmf_utterance` from one ``random.Random(seed)``; uid ``dtmf/{seed}/{i}``."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if not keys:
        raise ValueError("dtmf_sequences needs at least one key")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = "".join(rng.choice(keys) for _ in range(rng.randint(min_len, max_len)))
        u = dtmf_utterance(text, rng, snr_db=snr_db)
        out.append(Utterance(u.wave, u.text, u.speaker, u.source, f"dtmf/{seed}/{i}"))
    return out


def goertzel_power(frames_FN: np.ndarray, freqs: tuple[float, ...], sample_rate: int) -> np.ndarray:
    """Goertzel power ``(F, len(freqs))`` of every frame at every frequency, scaled so that a full-frame
    sinusoid of amplitude ``a`` at that exact frequency gives ``a**2``.

    Computed in closed form, ``|sum_n x[n] exp(-2j pi f n / sr)|**2 * 4 / N**2``, which is exactly what the
    Goertzel recurrence yields for a (possibly non-integer) DFT bin.
    """
    n = frames_FN.shape[1]
    t = np.arange(n) / sample_rate
    phase_NK = 2 * math.pi * np.outer(t, freqs)
    basis_N2K = np.concatenate([np.cos(phase_NK), np.sin(phase_NK)], axis=1)  # real BLAS, not complex
    proj_F2K = np.asarray(frames_FN, dtype=np.float64) @ basis_N2K
    k = len(freqs)
    return (proj_F2K[:, :k] ** 2 + proj_F2K[:, k:] ** 2) * (4.0 / n**2)


def frame_keys(
    wave: np.ndarray,
    sample_rate: int = SAMPLE_RATE,
    frame_s: float = 0.020,
    hop_s: float = 0.010,
    min_amplitude: float = 0.01,
    dominance: float = 4.0,
    max_twist_db: float = 8.0,
    min_tone_fraction: float = 0.5,
) -> list[str | None]:
    """The key heard in each ``frame_s`` frame (hop ``hop_s``), or None.

    A frame is a key when (1) its strongest row tone has at least ``dominance`` times the power of every
    other row tone, and likewise for the columns (4 = 6 dB); (2) both tones have amplitude at least
    ``min_amplitude``; (3) their levels differ by at most ``max_twist_db``; (4) the two tones carry at
    least ``min_tone_fraction`` of the frame's energy (which rejects noise, speech and chords).
    """
    x = np.asarray(wave, dtype=np.float64).reshape(-1)
    n, hop = round(frame_s * sample_rate), round(hop_s * sample_rate)
    if len(x) < n:
        return []
    n_frames = 1 + (len(x) - n) // hop
    frames_FN = np.lib.stride_tricks.sliding_window_view(x, n)[::hop][:n_frames]
    rows_FK = goertzel_power(frames_FN, ROW_FREQS, sample_rate)
    cols_FK = goertzel_power(frames_FN, COL_FREQS, sample_rate)
    energy_F = np.mean(frames_FN**2, axis=1)
    rows_sorted_FK, cols_sorted_FK = np.sort(rows_FK, axis=1), np.sort(cols_FK, axis=1)
    p_row_F, p_col_F = rows_sorted_FK[:, -1], cols_sorted_FK[:, -1]
    tiny = np.finfo(np.float64).tiny
    twist_db_F = 10.0 * np.log10(np.maximum(p_col_F, tiny) / np.maximum(p_row_F, tiny))
    ok_F = (
        (p_row_F >= dominance * rows_sorted_FK[:, -2])
        & (p_col_F >= dominance * cols_sorted_FK[:, -2])
        & (np.minimum(p_row_F, p_col_F) >= min_amplitude**2)
        & (np.abs(twist_db_F) <= max_twist_db)
        & ((p_row_F + p_col_F) / 2.0 >= min_tone_fraction * energy_F)
    )
    r_F, c_F = rows_FK.argmax(axis=1), cols_FK.argmax(axis=1)
    return [KEYPAD[r][c] if ok else None for r, c, ok in zip(r_F.tolist(), c_F.tolist(), ok_F.tolist())]


def goertzel_decode(
    wave: np.ndarray,
    sample_rate: int = SAMPLE_RATE,
    min_frames: int = 2,
    max_dropout: int = 1,
    **frame_kwargs,
) -> str:
    """The DTMF keys in ``wave`` (``""`` for silence, noise or speech), by :func:`frame_keys` and debouncing.

    Consecutive frames with the same key form a run; runs of one key separated by at most
    ``max_dropout`` key-less frames are merged (a momentary dropout is not a new key press); a run of at
    least ``min_frames`` frames is one key. A repeated key therefore needs a gap of more than
    ``max_dropout`` hops (10 ms by default) of no key between its presses; the generator's gaps are >= 50 ms.
    """
    labels = frame_keys(wave, sample_rate, **frame_kwargs)
    runs: list[list] = []  # [key, n_frames, index of last frame]
    for i, key in enumerate(labels):
        if key is None:
            continue
        if runs and runs[-1][0] == key and i - runs[-1][2] - 1 <= max_dropout:
            runs[-1][1] += 1
            runs[-1][2] = i
        else:
            runs.append([key, 1, i])
    return "".join(key for key, count, _ in runs if count >= min_frames)
