"""Build the speechocean762 benchmark: HDF5 sets, Kaldi text files, HCLG and words.txt.

usage: python examples/speechocean/build.py CORPUS OUTDIR [--dev-speakers 10]
           [--max-train-utts N] [--jobs 2] [--vocab lexicon|train] [--seed 0]

CORPUS is the directory the corpus was extracted to (``train/``, ``test/``, ``WAVE/``,
``resource/lexicon.txt``), or the corpus repository's git directory (extracted to
``OUTDIR/speechocean762`` first). Writes into OUTDIR:

- ``train.h5``, ``dev.h5``, ``test.h5`` and beside each its Kaldi ``text`` (``train.text``
  ...): the official training speakers less ``--dev-speakers`` of them (drawn with
  ``--seed``), those held-out training speakers (for choosing the acoustic scale and beam:
  never tune on test), and the 125 test speakers. 120 phone-state classes
  (:mod:`examples.speechocean.phones`), silence classes 0-2 recorded;
- ``align.jsonl``: pocketsphinx's alignments, reused by the next build;
- ``HCLG.fst`` and ``words.txt``: the decoding graph for ``python -m hadpsgd.decode --graph``
  (:mod:`examples.speechocean.graph`), with a bigram estimated on the transcripts of the
  training speakers (dev excluded);
- ``build.json``: what was built and measured (sizes, OOV rates, perplexities, times).

``--max-train-utts N`` aligns and writes only N training utterances (drawn with ``--seed``;
the language model still uses every training transcript): a quicker first build. Needs
pocketsphinx, kaldi-native-fbank and kaldifst (``pip install 'hadpsgd[examples,decode]'``).
Exit status 0, or 2 with one line saying what to do.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a file: make ``examples.speechocean`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hadpsgd.exit_codes import EXIT_OK, EXIT_USER_ERROR  # noqa: E402

PROG = "examples/speechocean/build.py"


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("corpus", type=Path, help="the extracted corpus, or its git directory")
    parser.add_argument("outdir", type=Path, help="where everything goes (made if missing)")
    parser.add_argument("--dev-speakers", type=int, default=10,
                        help="training speakers held out as the dev set (default 10)")
    parser.add_argument("--max-train-utts", type=int, default=None,
                        help="align and write at most this many training utterances")
    parser.add_argument("--jobs", type=int, choices=(1, 2), default=2,
                        help="processes aligning: this one, or this one and a worker (default 2)")
    parser.add_argument("--vocab", choices=("lexicon", "train"), default="lexicon",
                        help="decoding vocabulary: every lexicon word (default) or the "
                             "training transcripts' words")
    parser.add_argument("--seed", type=int, default=0, help="dev speakers and subset draw")
    parser.add_argument("--silence-prob", type=float, default=0.5,
                        help="optional silence after each word (default 0.5)")
    parser.add_argument("--self-loop-scale", type=float, default=0.1,
                        help="scale on the HMM transition costs (default 0.1, as mkgraph.sh)")
    return parser


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _progress(what: str, every: int) -> Callable[[int, int], None]:
    start = time.perf_counter()
    last = [0]

    def show(done: int, total: int) -> None:
        if done - last[0] >= every or done == total:
            last[0] = done
            _say(f"  {what}: {done}/{total} ({time.perf_counter() - start:.0f} s)")
    return show


def run(args: argparse.Namespace) -> dict[str, object]:
    """Build everything; returns the summary written to ``build.json``."""
    from examples.speechocean import align, corpus, features, graph, lm, phones
    from hadpsgd.decode.graph import estimate_self_loop_probs

    summary: dict[str, object] = {"builder": PROG, "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    start = time.perf_counter()
    root = corpus.corpus_root(args.corpus, args.outdir)
    train_all = corpus.read_split(root, "train")
    test = corpus.read_split(root, "test")
    train_lm, dev = corpus.hold_out_speakers(train_all, args.dev_speakers, args.seed)
    train = corpus.subset(train_lm, args.max_train_utts, args.seed)
    splits = {"train": train, "dev": dev, "test": test}
    lexicon = corpus.read_lexicon(root / "resource" / "lexicon.txt")
    _say(f"corpus {root}: train {len(train)} utterances ({len(train_lm)} with the language "
         f"model's), dev {len(dev)} ({args.dev_speakers} speakers), test {len(test)}")

    cache = align.AlignmentCache(args.outdir / "align.jsonl")
    t0 = time.perf_counter()
    every = [u for part in splits.values() for u in part]
    alignments = align.align_all(every, lexicon, cache, args.jobs,
                                 _progress("aligned", 200))
    failed = sorted(k for k, a in alignments.items() if a.error)
    summary["alignment"] = {"utterances": len(alignments), "failed": len(failed),
                            "failed_ids": failed[:50],
                            "wall_s": round(time.perf_counter() - t0, 1),
                            "decoder_s": round(sum(a.seconds for a in alignments.values()), 1)}
    _say(f"alignments: {len(alignments)}, {len(failed)} failed, "
         f"{time.perf_counter() - t0:.0f} s")

    sizes = {}
    for name, utts in splits.items():
        t0 = time.perf_counter()
        done = features.write_split(args.outdir / f"{name}.h5", utts, alignments,
                                    {"builder": PROG, "split": name, "seed": args.seed},
                                    _progress(f"{name}.h5", 500))
        sizes[name] = {**vars(done), "seconds": round(time.perf_counter() - t0, 1)}
        _say(f"{name}.h5: {done.utts} utterances ({done.speakers} speakers, {done.failed} "
             f"left out), {done.frames} frames ({done.frames / 360000:.2f} h), silence "
             f"{done.silence:.0%}")
    summary["sets"] = sizes

    t0 = time.perf_counter()
    train_vocab = corpus.vocabulary(train_lm)
    words = set(lexicon) if args.vocab == "lexicon" else set(train_vocab)
    decode_lexicon = {w: lexicon[w] for w in sorted(words)}
    model = lm.BigramLM.estimate([u.words for u in train_lm], words)
    labels = [align.frame_labels(alignments[u.utt_id], alignments[u.utt_id].frames)
              for u in train if not alignments[u.utt_id].error]
    offsets = np.cumsum([0, *map(len, labels)])
    loops = estimate_self_loop_probs(np.concatenate(labels), offsets, phones.NUM_CLASSES)
    hclg, syms = graph.build_hclg(decode_lexicon, model, loops, args.silence_prob,
                                  args.self_loop_scale)
    hclg.write(str(args.outdir / "HCLG.fst"))
    graph.write_words(syms, args.outdir / "words.txt")
    states, arcs = graph.num_arcs(hclg)
    lm_report = {}
    for name, utts in (("dev", dev), ("test", test)):
        oov_train, tokens = corpus.oov_rate(utts, train_vocab)
        oov_decode, _ = corpus.oov_rate(utts, words)
        ppl, scored = model.perplexity([u.words for u in utts])
        lm_report[name] = {"tokens": tokens, "oov_vs_train_vocab": round(oov_train / tokens, 4),
                           "oov_vs_decode_vocab": round(oov_decode / tokens, 4),
                           "perplexity": round(ppl, 1), "perplexity_tokens": scored}
    summary["graph"] = {"vocab": args.vocab, "words": len(words),
                        "train_vocab": len(train_vocab), "hclg_states": states,
                        "hclg_arcs": arcs, "seconds": round(time.perf_counter() - t0, 1),
                        "lm": lm_report}
    _say(f"HCLG.fst: {states} states, {arcs} arcs, {len(words)} words ({args.vocab}); "
         + "; ".join(f"{k} OOV {v['oov_vs_train_vocab']:.1%} of the training vocabulary, "
                     f"perplexity {v['perplexity']}" for k, v in lm_report.items()))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Parse, check the tools, build; the exit status."""
    args = build_parser().parse_args(argv)
    for module, package in (("pocketsphinx", "pocketsphinx"),
                            ("kaldi_native_fbank", "kaldi-native-fbank"),
                            ("kaldifst", "kaldifst")):
        try:
            __import__(module)
        except ImportError:
            print(f"{PROG}: error: this needs {package}: pip install "
                  "'hadpsgd[examples,decode]'", file=sys.stderr)
            return EXIT_USER_ERROR
    if args.dev_speakers < 0 or (args.max_train_utts is not None and args.max_train_utts < 1):
        print(f"{PROG}: error: --dev-speakers must be >= 0 and --max-train-utts >= 1",
              file=sys.stderr)
        return EXIT_USER_ERROR
    from examples.speechocean.corpus import CorpusError

    args.outdir.mkdir(parents=True, exist_ok=True)
    try:
        summary = run(args)
    except CorpusError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    (args.outdir / "build.json").write_text(json.dumps(summary, indent=1) + "\n",
                                            encoding="utf-8")
    print(f"built {args.outdir} in {summary['seconds']} s")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
