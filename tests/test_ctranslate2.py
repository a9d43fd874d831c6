"""`attnlab export --format ctranslate2` decoded by CTranslate2 itself (an independent C++ implementation of the
Transformer and of greedy and beam search), on small models trained here: a translation model and a language
model give attnlab's tokens."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from attnlab.cli import main
from attnlab.data.tokenizer import Tokenizer
from attnlab.decode import beam_search, generate, greedy_search
from attnlab.evaluate import load_module
from conftest import make_pairs
from test_cli import LM
from test_train import write_recipe

ctranslate2 = pytest.importorskip("ctranslate2")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Marian-shaped translation model (post-norm LayerNorm, ReLU, sinusoids, one shared table) and a
    Llama-shaped LM, each trained for 150 steps, exported to CTranslate2."""
    root = tmp_path_factory.mktemp("ct2")
    recipe = write_recipe(root, n_pairs=2000, model={"dropout": 0.0}, optim={"lr": 3e-3},
                          trainer={"run_name": "mt", "max_steps": 150, "val_every": 1000, "ckpt_every": 150})
    assert main(["fit", "-c", str(recipe)]) == 0
    docs = root / "docs.txt"
    docs.write_text("".join(t + "\n\n" for _, t in make_pairs(2000, seed=4)), encoding="utf-8")
    lm = {k: dict(v) for k, v in LM.items()}
    lm["data"].update(corpus=str(docs), data_dir=str(root / "lm_cache"))
    lm["trainer"].update(runs_dir=str(root / "runs"), run_name="lm", max_steps=150, val_every=1000, ckpt_every=150)
    (root / "lm.yaml").write_text(yaml.safe_dump({"name": "lm", **lm}), encoding="utf-8")
    assert main(["fit", "-c", str(root / "lm.yaml")]) == 0
    out = {}
    for name in ("mt", "lm"):
        ckpt = root / "runs" / name / "checkpoints" / "last.ckpt"
        assert main(["export", "--ckpt", str(ckpt), "--format", "ctranslate2", "--out", str(root / f"ct2-{name}")]) == 0
        out[name] = (ckpt, root / f"ct2-{name}", Tokenizer.load(root / "runs" / name / "tokenizer"))
    return out


def test_greedy_translation_is_attnlabs_on_every_sentence_or_a_near_tie(trained):
    ckpt, folder, tok = trained["mt"]
    module = load_module(ckpt)
    cfg = module.decode_cfg
    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type="float32")
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)  # the tokenizer files travel with the model
    lines = [s for s, _ in make_pairs(200, seed=11)]
    same, outputs = 0, set()
    for line in lines:
        ids = tok.encode(line) + [tok.eos_id]
        assert hf_tok(line)["input_ids"] == ids  # the exported tokenizer ends a source with </s>, as in training
        src = torch.tensor([ids])  # (1, S)
        limit = int(cfg.max_len_a * len(ids) + cfg.max_len_b)
        [ours] = greedy_search(module.model, src, max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b)
        [result] = translator.translate_batch([hf_tok.convert_ids_to_tokens(ids)], beam_size=1,
                                              max_decoding_length=limit)
        theirs = hf_tok.convert_tokens_to_ids(result.hypotheses[0])
        outputs.add(tuple(ours))
        if theirs == ours:
            same += 1
            continue
        # where they part, attnlab's own log-probabilities must make the two tokens a near-tie
        ends = ours + [tok.eos_id], theirs + [tok.eos_id]
        at = next(i for i, (a, b) in enumerate(zip(*ends, strict=False)) if a != b)
        tgt = torch.tensor([[tok.bos_id] + ours[:at]])
        with torch.no_grad():
            logp = module.model(src, tgt)[0, -1].log_softmax(-1)  # (V,)
        pair = ends[0][at], ends[1][at]
        assert abs(float(logp[pair[0]] - logp[pair[1]])) < 1e-3, (line, pair)
    assert same / len(lines) >= 0.99 and len(outputs) > 50, same


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_beam_4_with_fairseqs_length_penalty_is_attnlabs(trained, alpha):
    """Both rank finished hypotheses by log p(y + EOS) / (|y| + 1)^alpha. They differ only for a hypothesis cut at
    the maximum length: attnlab (as fairseq) forces its EOS and counts that EOS's log-probability and length,
    CTranslate2 counts neither; sentences whose best hypothesis is cut there are left out (and counted)."""
    ckpt, folder, tok = trained["mt"]
    module = load_module(ckpt)
    cfg = module.decode_cfg
    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type="float32")
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    compared = same = 0
    for line in [s for s, _ in make_pairs(100, seed=12)]:
        ids = tok.encode(line) + [tok.eos_id]
        limit = int(cfg.max_len_a * len(ids) + cfg.max_len_b)
        [[(ours, score)]] = beam_search(module.model, torch.tensor([ids]), beam_size=4, len_penalty=alpha,
                                        penalty="fairseq", max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b)
        [result] = translator.translate_batch([hf_tok.convert_ids_to_tokens(ids)], beam_size=4,
                                              length_penalty=alpha, max_decoding_length=limit, return_scores=True)
        theirs = hf_tok.convert_tokens_to_ids(result.hypotheses[0])
        if limit in (len(ours), len(theirs)):
            continue
        compared += 1
        same += theirs == ours
        if theirs == ours:
            assert result.scores[0] == pytest.approx(score, rel=3e-4)  # float32 sums in another order
    assert compared >= 80 and same == compared, (same, compared)


def test_greedy_generation_of_the_language_model_is_attnlabs(trained):
    ckpt, folder, tok = trained["lm"]
    model = load_module(ckpt).model
    generator = ctranslate2.Generator(str(folder), device="cpu", compute_type="float32")
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for prompt in ("der Hund", "Die Datei", "Speichern", ""):
        ids = hf_tok(prompt)["input_ids"]  # the exported tokenizer starts with </s>, as attnlab generate does
        assert ids == [tok.eos_id] + tok.encode(prompt, side="tgt")
        [ours] = generate(model, torch.tensor([ids]), max_new_tokens=20, greedy=True, eos_id=tok.eos_id)
        [result] = generator.generate_batch([hf_tok.convert_ids_to_tokens(ids)], max_length=20, sampling_topk=1,
                                            include_prompt_in_result=False, end_token="</s>")
        theirs = ids + result.sequences_ids[0]
        assert theirs == ours[: len(theirs)] and len(ours) - len(theirs) <= 1, prompt  # attnlab keeps the EOS
        assert math.isfinite(len(theirs)) and len(theirs) > len(ids) + 3


# CTranslate2's two int8 GEMMs on an x86 CPU, each forced in its own process so that the test is the same on every
# x86 CPU (docs/decoding.md): Intel MKL (its default on Intel CPUs; CT2_USE_MKL=1 elsewhere), and oneDNN (its
# default on AMD's) held to AVX2, the path of every AMD CPU without AVX-512. There oneDNN sums pairs of u8 x s8
# products into saturating 16-bit lanes (vpmaddubsw), where VNNI (vpdpbusd) and MKL sum into 32 bits.
INT8_PATHS = {"MKL on AVX2": {"CT2_USE_MKL": "1", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
              "oneDNN on AVX2": {"CT2_USE_MKL": "0", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
INT8_RUN = """
import json, sys
import ctranslate2
batch, limit = json.load(sys.stdin)
out = {}
for q, folder in zip(("float32", "int8"), sys.argv[1:]):
    t = ctranslate2.Translator(folder, device="cpu", compute_type=q, inter_threads=1, intra_threads=1)
    out[q] = [r.hypotheses[0] for r in t.translate_batch(batch, beam_size=1, max_decoding_length=limit)]
    out[q + "_scores"] = [r.log_probs for r in t.score_batch(batch, out["float32"])]
print(json.dumps(out))
"""


def int8_against_float32(folder, int8, sources: list[list[str]], env: dict[str, str]) -> dict:
    """Greedy hypotheses of both conversions, and each one's log-probs of float32's hypotheses, in a new process
    whose environment picks CTranslate2's int8 kernels."""
    r = subprocess.run([sys.executable, "-c", INT8_RUN, str(folder), str(int8)], input=json.dumps([sources, 120]),
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_int8_keeps_float32s_text_through_mkl_and_loses_it_through_onednn_on_avx2(trained, tmp_path, capsys):
    """`--quantization int8`: CTranslate2 stores int8 weights (model.bin under half the float32 one) and, through
    MKL, greedy search on the trained model gives float32's text on at least 60% of 200 sentences and float32's
    token at 80% of positions (measured 73% and 90%, as with AVX-512 VNNI), each token's log-prob within 0.5 nats
    (measured 0.15). Through oneDNN on AVX2 it keeps neither (measured 3 of 200 and 27%, up to 2.2 nats): what
    docs/decoding.md tells users of such CPUs (CT2_USE_MKL=1). A quantization it does not know is a one-line
    error."""
    ckpt, folder, tok = trained["mt"]
    int8 = tmp_path / "int8"
    assert main(["export", "--ckpt", str(ckpt), "--format", "ctranslate2", "--out", str(int8),
                 "--quantization", "int8"]) == 0
    assert (int8 / "model.bin").stat().st_size < 0.5 * (folder / "model.bin").stat().st_size
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    sources = [hf_tok.convert_ids_to_tokens(tok.encode(s) + [tok.eos_id]) for s, _ in make_pairs(200, seed=13)]
    kept = {}
    for path, env in INT8_PATHS.items():
        out = int8_against_float32(folder, int8, sources, env)
        pairs = list(zip(out["float32"], out["int8"], strict=True))
        same = sum(a == b for a, b in pairs) / len(pairs)
        agree = [sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b), 1) for a, b in pairs]
        tokens = sum(agree) / len(pairs)  # the share of positions where int8's token is float32's
        moved = max(abs(x - y) for a, b in zip(out["float32_scores"], out["int8_scores"], strict=True)
                    for x, y in zip(a, b, strict=True))
        assert moved > 0, path  # int8 ran: its log-probs are not float32's
        kept[path] = same >= 0.6 and tokens >= 0.8 and moved < 0.5, (same, tokens, moved)
    assert kept["MKL on AVX2"][0] and not kept["oneDNN on AVX2"][0], kept
    assert main(["export", "--ckpt", str(ckpt), "--format", "ctranslate2", "--out", str(tmp_path / "x"),
                 "--quantization", "int3"]) == 2
    assert "int3 is not a valid quantization type" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_a_variant_it_cannot_represent_is_refused_naming_the_fields(trained, tmp_path, capsys):
    ckpt, _, _ = trained["mt"]
    recipe = write_recipe(tmp_path, model={"qk_norm": True, "attn_softcap": 30.0, "attention_backend": "eager"},
                          trainer={"run_name": "x", "max_steps": 2})
    assert main(["fit", "-c", str(recipe)]) == 0
    capsys.readouterr()
    assert main(["export", "--ckpt", str(tmp_path / "runs" / "x" / "checkpoints" / "last.ckpt"), "--format",
                 "ctranslate2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "CTranslate2's Transformer cannot represent this variant" in err
    assert "model.qk_norm=True (needs False for a translation model" in err and "model.attn_softcap=30.0" in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "in.txt").write_text("Open File\n", encoding="utf-8")
    assert main(["translate", "--ckpt", str(tmp_path / "runs" / "x" / "checkpoints" / "last.ckpt"), "--input",
                 str(tmp_path / "in.txt"), "--engine", "ctranslate2"]) == 2
    err = capsys.readouterr().err
    assert "decode.engine=ctranslate2 cannot decode it" in err and "model.attn_softcap=30.0" in err
    assert not list((tmp_path / "runs" / "x" / "ct2").iterdir())  # nothing half-made left behind


def test_translate_with_engine_ctranslate2_converts_once_and_gives_attnlabs_text(trained, tmp_path, capsys,
                                                                                 monkeypatch):
    """`attnlab translate --engine ctranslate2`: the checkpoint is converted on first use into <run dir>/ct2/ and
    loaded from there afterwards, its Translator kept for the next call in the process; greedy, the lines are
    attnlab's own."""
    from attnlab import export_ct2

    ckpt, _, _ = trained["mt"]
    src = tmp_path / "in.txt"
    src.write_text("".join(s + "\n" for s, _ in make_pairs(200, seed=13)), encoding="utf-8")
    base = ["translate", "--ckpt", str(ckpt), "--input", str(src), "--beam", "1", "--device", "cpu"]
    assert main(base) == 0
    ours = capsys.readouterr().out.splitlines()
    conversions, loads = [], []
    convert = export_ct2.export_ctranslate2
    monkeypatch.setattr(export_ct2, "export_ctranslate2", lambda *a, **k: conversions.append(a) or convert(*a, **k))
    monkeypatch.setattr(export_ct2, "_TRANSLATORS", {})
    load = ctranslate2.Translator
    monkeypatch.setattr(ctranslate2, "Translator", lambda *a, **k: loads.append(a) or load(*a, **k))
    for _ in range(2):
        assert main([*base, "--engine", "ctranslate2"]) == 0
        theirs = capsys.readouterr().out.splitlines()
        assert len(theirs) == len(ours) == 200
        assert sum(a == b for a, b in zip(ours, theirs, strict=True)) >= 198, [
            (a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    assert len(conversions) == 1, "converted once, then loaded"
    assert len(loads) == 1, "the Translator loaded once, then kept"
    threads = torch.get_num_threads()
    try:  # --threads: torch's thread count, so as many batches at once; the same lines
        assert main([*base, "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.splitlines() == ours
    [folder] = (ckpt.parent.parent / "ct2").glob("last-*")
    assert (folder / "model.bin").is_file() and len(folder.name) == len("last-") + 12


def test_the_final_evaluation_with_engine_ctranslate2_scores_attnlabs_beams(trained):
    """An ablation's final evaluation (final.evaluate_run) with decode.engine ctranslate2 (beam 4, fairseq's
    penalty, which both implement): the test hypotheses are attnlab's, but for those cut at the maximum length
    (counted differently, see test_beam_4_with_fairseqs_length_penalty_is_attnlabs), and the scores follow."""
    from attnlab.ablate.final import evaluate_run
    from attnlab.experiment import load_experiment

    ckpt, _, _ = trained["mt"]
    run_dir = ckpt.parent.parent
    recipe = run_dir.parent.parent / "tiny.yaml"
    hyps, scores = {}, {}
    for engine in ("attnlab", "ctranslate2"):
        exp = load_experiment(recipe, {"decode.engine": engine, "decode.beam": 4, "decode.penalty": "fairseq"})
        scores[engine] = evaluate_run(exp, run_dir)
        hyps[engine] = (run_dir / "eval" / "test.hyp").read_text(encoding="utf-8").splitlines()
        assert scores[engine]["engine"] == engine
    same = sum(a == b for a, b in zip(hyps["attnlab"], hyps["ctranslate2"], strict=True))
    assert len(hyps["attnlab"]) >= 80 and same >= 0.95 * len(hyps["attnlab"]), same
    assert abs(scores["attnlab"]["test_bleu"] - scores["ctranslate2"]["test_bleu"]) < 1.0, scores


def test_the_decoding_benchmark_against_ctranslate2_runs_every_row(trained, tmp_path):
    """bench/decode_vs_ct2.py, which bench/RESULTS.md's tables come from, on 20 sentences (its engines in this
    process, --in-process): every row runs with its configuration, CTranslate2's texts are attnlab's greedy ones,
    attnlab's own CPU batches (by tokens), the decode config's (--config-batches) and batches of 8 sentences
    (--more-batches) give the same texts, and the JSON is written."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import decode_vs_ct2

    ckpt, _, _ = trained["mt"]
    threads = torch.get_num_threads()
    try:
        rows = decode_vs_ct2.main(["--ckpt", str(ckpt), "--threads", "1", "--limit", "20", "--repeats", "1",
                                   "--in-process", "--config-batches", "--more-batches", "8", "--json",
                                   str(tmp_path / "rows.json")])
    finally:
        torch.set_num_threads(threads)
    by_row = {r["row"]: r for r in rows}
    assert set(by_row) == {f"{what} {b}{more}" for b in ("beam 1", "beam 4") for what, more in (
        ("attnlab", ""), ("ctranslate2", ""), ("ctranslate2", ", max_decoding_length 256"),
        ("attnlab --engine ctranslate2,", ""), ("attnlab", ", the decode config's batches"),
        ("attnlab", ", batches of 8 sentences"))}
    assert all(r["status"] == "ok" and r["sent_per_s"] > 0 and r["config"] for r in rows), rows
    assert by_row["attnlab beam 4"]["same_text"] == 1.0  # attnlab's text is the reference
    decode = load_module(ckpt).decode_cfg
    for b in (1, 4):  # on a CPU by tokens (evaluate.batch_sizes), beside the decode config's as they are
        assert by_row[f"attnlab beam {b}"]["config"]["batch_sentences"] == 1024 // b
        config = by_row[f"attnlab beam {b}, the decode config's batches"]
        assert config["config"]["batch_sentences"] == decode.batch_sentences != 1024 // b
        assert config["same_text"] == 1.0
        more = by_row[f"attnlab beam {b}, batches of 8 sentences"]  # --more-batches: 3 batches of the 20
        assert more["config"]["batch_sentences"] == 8 and more["same_text"] == 1.0
    assert by_row["ctranslate2 beam 4"]["config"]["batch_type"] == "tokens"  # as CTranslate2's users run it
    for what in ("ctranslate2", "attnlab --engine ctranslate2,"):
        assert by_row[f"{what} beam 1"]["same_text"] >= 0.95  # 19 of 20; near-ties aside
    assert len(json.loads((tmp_path / "rows.json").read_text())["rows"]) == 12


def test_the_decoding_benchmark_in_rounds_counts_every_rounds_passes(trained, tmp_path):
    """bench/decode_vs_ct2.py --rounds 2: the engines run in turn twice; each row's passes are both rounds' (its
    sentences/s their mean, beside each round's own), and a row that failed in any round is a failed row."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import decode_vs_ct2

    ckpt, _, _ = trained["mt"]
    threads = torch.get_num_threads()
    try:
        rows = decode_vs_ct2.main(["--ckpt", str(ckpt), "--threads", "1", "--limit", "10", "--repeats", "2",
                                   "--rounds", "2", "--beams", "1", "--engines", "attnlab,ctranslate2",
                                   "--in-process"])
    finally:
        torch.set_num_threads(threads)
    assert [r["row"] for r in rows] == ["attnlab beam 1", "ctranslate2 beam 1",
                                        "ctranslate2 beam 1, max_decoding_length 256"]
    for r in rows:
        assert r["status"] == "ok" and r["rounds"] == 2 and len(r["seconds"]) == 4 and len(r["round_sent_per_s"]) == 2
        assert r["sent_per_s"] == pytest.approx(10 / (sum(r["seconds"]) / 4), rel=1e-2)  # seconds are rounded
    assert rows[1]["same_text"] >= 0.9
    ok = {"row": "a", "seconds": [1.0, 2.0], "texts": ["x"]}
    failed = [{"row": "a", "error": "RuntimeError: boom"}]
    first = {"load_before": 1.0, "load_after": 2.0, "others_cpu_share": 0.1}
    last = {"load_before": 3.0, "load_after": 4.0, "others_cpu_share": 0.3}
    merged, loads = decode_vs_ct2.merge_rounds([([ok], first), (failed, last)], 3)
    assert merged == [{"row": "a", "error": "RuntimeError: boom"}]
    assert loads == {"load_before": 1.0, "load_after": 4.0, "rounds": 2, "others_cpu_share": 0.3}
    with pytest.raises(SystemExit):
        decode_vs_ct2.main(["--ckpt", str(ckpt), "--rounds", "0"])
    # what others took of 2 CPUs over 2 s: 10 busy seconds, 4 of them the child's, 3 stolen by the hypervisor
    assert decode_vs_ct2.shares((10.0, 1.0, 2.0), (20.0, 5.0, 5.0), 2.0, 2) == {"others_cpu_share": 0.75,
                                                                              "steal_share": 0.75}
    busy, children, stolen = decode_vs_ct2.cpu_seconds()  # this machine's /proc/stat
    assert busy >= stolen >= 0 and children >= 0


@pytest.mark.parametrize(("a", "b", "alpha"), [(1.0, 10, 1.0), (0.5, 2, 1.0), (0.5, 2, 0.0)])
def test_the_engine_keeps_each_sentences_maximum_length_in_few_calls(trained, a, b, alpha, monkeypatch):
    """ct2_translate at beam 4 with maximum lengths a * source + b that cut some searches (a = 1, b = 10) or most
    (a = 0.5, b = 2): one call a batch, to its shortest maximum, then the sentences that reached it again with their
    own; the tokens are those of one call per maximum length (what each sentence's own maximum gives) on every
    sentence. With alpha 0 CTranslate2's stopping rule depends on the hypotheses asked for: one call per maximum
    length there."""
    from attnlab import export_ct2
    from attnlab.config import DecodeConfig
    from attnlab.evaluate import token_batches

    ckpt, _, tok = trained["mt"]
    decode = DecodeConfig(max_len_a=a, max_len_b=b, penalty="fairseq", len_penalty=alpha)
    sources = [tok.encode(s) + [tok.eos_id] for s, _ in make_pairs(200, seed=17)]
    limits = [int(a * len(s) + b) for s in sources]
    batches = token_batches([len(s) for s in sources], 200, 1000)
    calls = []
    real = export_ct2._queued
    monkeypatch.setattr(export_ct2, "_queued", lambda tr, toks, c, *x: calls.append(len(c)) or real(tr, toks, c, *x))
    ids = export_ct2.ct2_translate(ckpt, sources, batches, decode, 4, torch.device("cpu"), None, workers=1)
    folder = export_ct2.converted(ckpt)
    vocab = export_ct2.vocabulary(folder)
    index = {t: i for i, t in enumerate(vocab)}
    translator = ctranslate2.Translator(str(folder), device="cpu", compute_type="float32")
    by_limit = [([i for i in b if limits[i] == n], n) for b in batches for n in sorted({limits[i] for i in b})]
    want = {}
    for idx, n in by_limit:
        for i, r in zip(idx, translator.translate_batch([[vocab[t] for t in sources[i]] for i in idx], beam_size=4,
                                                         length_penalty=alpha, max_decoding_length=n), strict=True):
            want[i] = [index[t] for t in r.hypotheses[0]]
    assert ids == [want[i] for i in range(len(sources))]
    cut = sum(len(h) == n for h, n in zip(ids, limits, strict=True))
    assert 0 < cut < len(sources) // 4 if a == 1.0 else cut > len(sources) // 3, cut
    if not alpha:
        assert calls == [len(by_limit), 0]
    else:  # a call a batch, then one a maximum length of the sentences that reached their batch's shortest
        assert calls[0] == len(batches) and 0 < calls[1] <= len(set(limits)), calls
        assert sum(calls) < len(by_limit) or a < 1, (calls, len(by_limit))


@pytest.mark.parametrize("fails_at", ["load", "decode"])
def test_a_gpu_without_cuda_12s_cublas_gets_what_to_install(tmp_path, monkeypatch, fails_at):
    """CTranslate2's wheels open libcublas.so.12 by name, at loading or at the first matrix product: on a machine
    with only CUDA 13's cuBLAS (the H100 image's) `--engine ctranslate2` on a GPU says what to install; any other
    error of CTranslate2's passes through as it is."""
    from attnlab import export_ct2
    from attnlab.config import ConfigError, DecodeConfig

    missing = "Library libcublas.so.12 is not found or cannot be loaded"

    class Pending:
        def __init__(self, error):
            self.error = error

        def result(self):
            raise RuntimeError(self.error)

    class FakeCT2:
        __version__ = "4.8.5"
        error = missing

        class Translator:
            def __init__(self, *a, **k):
                if fails_at == "load":
                    raise RuntimeError(FakeCT2.error)

            def translate_batch(self, batch, **k):
                return [Pending(FakeCT2.error) for _ in batch]

    monkeypatch.setattr(export_ct2, "_ct2", lambda what: FakeCT2)
    monkeypatch.setattr(export_ct2, "converted", lambda ckpt: tmp_path)
    monkeypatch.setattr(export_ct2, "vocabulary", lambda folder: ["<pad>", "<s>", "</s>", "a", "b"])

    def decode():
        return export_ct2.ct2_translate(tmp_path / "last.ckpt", [[3, 4, 2]], [[0]], DecodeConfig(), 1,
                                        torch.device("cuda"), None)

    with pytest.raises(ConfigError) as e:
        decode()
    assert missing in str(e.value) and "pip install nvidia-cublas-cu12" in str(e.value)
    assert "LD_LIBRARY_PATH" in str(e.value) and "decode.engine=attnlab" in str(e.value)
    FakeCT2.error = "CUDA failed with error out of memory"
    with pytest.raises(RuntimeError, match="^CUDA failed with error out of memory$"):
        decode()
