"""The digit-set builder (examples/digits): audio, labels, features, the command.

Everything but the last test runs on synthetic waveforms, without espeak-ng; the last builds
a two-speaker set when espeak-ng is installed and is skipped otherwise.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("kaldi_native_fbank")

from examples.digits import audio, build, features  # noqa: E402
from examples.digits.audio import SAMPLE_RATE  # noqa: E402


def _tone_word(freq: float, seconds: float) -> np.ndarray:
    t = np.arange(round(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _runs(labels: np.ndarray) -> list[tuple[int, int]]:
    """(label, run length) of each run."""
    cuts = np.flatnonzero(np.diff(labels)) + 1
    return [(int(p[0]), len(p)) for p in np.split(labels, cuts)]


def test_each_word_is_three_equal_states_of_its_digit_between_silence():
    words = [_tone_word(300 + 100 * d, 0.2 + 0.02 * d) for d in range(10)]
    rng = np.random.default_rng(0)
    for digits in ([4, 8, 2, 1], [7, 7], [0, 9, 5, 3, 6]):
        utt = audio.utterance(words, digits, rng)
        feats = features.log_mel_deltas(utt.samples)
        labels = features.frame_labels(utt, len(feats))
        assert feats.shape == (features.num_frames(len(utt.samples)), 120)
        assert len(feats) == 1 + (len(utt.samples) - 400) // 160  # 25 ms / 10 ms, snip edges
        assert labels[0] == labels[-1] == features.SILENCE_CLASS
        speech = [(c, n) for c, n in _runs(labels) if c != features.SILENCE_CLASS]
        # Words back to back still start at state 0 of the next digit.
        assert [c for c, _ in speech] == [3 * d + k for d in digits for k in range(3)]
        for w in range(len(digits)):
            counts = [n for _, n in speech[3 * w:3 * w + 3]]
            assert max(counts) - min(counts) <= 1, counts
        # A word's frames are those whose centre lies in its span.
        centres = np.arange(len(labels)) * 160 + 200
        for (start, stop), d in zip(utt.spans, digits, strict=True):
            inside = (centres >= start) & (centres < stop)
            assert (labels[inside] // 3 == d).all() and (labels[inside] < 30).all()


def test_a_word_too_short_for_three_states_is_refused():
    utt = audio.Utterance(samples=np.zeros(4000, np.float32), digits=(3,),
                          spans=((1000, 1200),))
    with pytest.raises(ValueError, match="digit 3 .* fewer than its 3 states"):
        features.frame_labels(utt, features.num_frames(4000))


def test_speaker_cmvn_gives_zero_mean_unit_variance_over_the_speaker():
    rng = np.random.default_rng(1)
    feats = [rng.normal(5.0, 3.0, (n, 120)).astype(np.float32) for n in (50, 80, 120)]
    normed = np.concatenate(features.speaker_cmvn(feats))
    np.testing.assert_allclose(normed.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(normed.std(axis=0), 1.0, atol=1e-3)


def test_resampling_keeps_a_tone_and_the_voiced_span_drops_silence():
    t = np.arange(22050) / 22050
    tone = np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    out = audio.resample(tone, 22050, SAMPLE_RATE)
    assert len(out) == SAMPLE_RATE
    assert np.argmax(np.abs(np.fft.rfft(out))) == 1000  # 1 Hz bins over one second
    padded = np.concatenate([np.zeros(3200), out[:4800], np.zeros(1600)]).astype(np.float32)
    start, stop = audio.voiced_span(padded)
    assert (start, stop) == (3200, 8000)


def test_noise_is_at_the_drawn_signal_to_noise_ratio():
    words = [_tone_word(500, 0.3)] * 10
    snr_lo, snr_hi = audio.SNR_DB
    for seed in range(5):
        utt = audio.utterance(words, [1, 2], np.random.default_rng(seed))
        # The leading pause is noise only; the words are speech plus the same noise.
        speech = np.concatenate([utt.samples[a:b] for a, b in utt.spans])
        noise = np.mean(np.square(utt.samples[:utt.spans[0][0]]))
        snr = 10 * np.log10((np.mean(np.square(speech)) - noise) / noise)
        assert snr_lo - 1 < snr < snr_hi + 1, snr


def test_without_espeak_the_builder_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert build.main([str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "espeak-ng" in err and "apt-get install espeak-ng" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
def test_a_small_set_is_readable_and_its_ids_carry_the_references(tmp_path):
    from hadpsgd.data import FeatureFile
    from hadpsgd.decode.wer import read_text, reference_from_utt_id

    assert build.main([str(tmp_path), "--train-speakers", "1", "--heldout-speakers", "1",
                       "--utts-per-speaker", "2"]) == 0
    for split, utts in (("train", 2), ("heldout", 1)):
        data = FeatureFile(tmp_path / f"{split}.h5", expected_feat_dim=120, verify=True)
        assert data.num_classes == 31 and len(data.utt_ids) == utts
        text = read_text(tmp_path / f"{split}.text")
        assert {u: reference_from_utt_id(u) for u in data.utt_ids} == text
        assert all(2 <= len(words) <= 5 for words in text.values())
    # The held-out speaker's voice and variant are none of the training's.
    held = FeatureFile(tmp_path / "heldout.h5").utt_ids[0]
    voice, variant = held.split("-", 1)[1].rsplit("-", 2)[0].split("+")
    from examples.digits import voices

    assert voice in voices.HELDOUT_VOICES and variant in voices.HELDOUT_VARIANTS
    assert voice not in voices.TRAIN_VOICES and variant not in voices.TRAIN_VARIANTS
