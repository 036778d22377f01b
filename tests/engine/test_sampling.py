"""Sampling: seeded reproducibility, penalties, min/max tokens, EOS handling."""

from __future__ import annotations

import pytest
import torch

from service.core.forward_batch import SamplingBatch
from service.core.request import FinishReason, SamplingParams
from service.engine.engine import collect
from service.engine.sampler import Sampler, counter_uniform

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2]  # arbitrary tokens


def _ids(client, prompt, params):
    return collect(client.generate([prompt], params)[0])[0]


def test_seeded_sampling_same_alone_and_in_a_busy_batch(smol_client, hf_tokenizer):
    prompt = hf_tokenizer.encode("Once upon a time")
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_new_tokens=24, ignore_eos=True)
    alone = _ids(smol_client, prompt, sp)
    others = [hf_tokenizer.encode(t) for t in ("A", "The weather today", "def f(x):", "Numbers: 1, 2")]
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_new_tokens=10 + 7 * i) for i in range(4)] + [sp]
    outs = smol_client.generate(others + [prompt], params)
    assert collect(outs[-1])[0] == alone
    assert _ids(smol_client, prompt, SamplingParams(**{**vars(sp), "seed": 99})) != alone


def test_penalties_min_p_and_repeatability(smol_client, hf_tokenizer):
    prompt = hf_tokenizer.encode("List fruits: apple, apple, apple,")
    sp = SamplingParams(
        temperature=0.7,
        min_p=0.05,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        seed=5,
        max_new_tokens=20,
        ignore_eos=True,
    )
    a = _ids(smol_client, prompt, sp)
    b = collect(
        smol_client.generate(
            [prompt, hf_tokenizer.encode("Hi")], [sp, SamplingParams(temperature=0, max_new_tokens=30)]
        )[0]
    )[0]
    assert a == b
    plain = _ids(smol_client, prompt, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True))
    penalised = _ids(
        smol_client,
        prompt,
        SamplingParams(temperature=0, repetition_penalty=2.0, max_new_tokens=20, ignore_eos=True),
    )
    assert plain != penalised
    apple = hf_tokenizer.encode(" apple")[0]
    assert penalised.count(apple) <= plain.count(apple)


def test_min_new_tokens_and_ignore_eos(smol_client, hf_tokenizer):
    chat = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say OK."}], add_generation_prompt=True, tokenize=True
    )
    chat = list(chat["input_ids"]) if hasattr(chat, "keys") else list(chat)
    short = smol_client.generate([chat], SamplingParams(temperature=0, max_new_tokens=64))[0]
    ids, _, last = collect(short)
    assert last.finish_reason is FinishReason.STOP and ids[-1] == 2 and last.matched_stop == 2
    n = len(ids)
    forced = collect(
        smol_client.generate([chat], SamplingParams(temperature=0, max_new_tokens=64, min_new_tokens=n + 3))[
            0
        ]
    )
    assert len(forced[0]) >= n + 3 and 2 not in forced[0][: n + 3]
    ign = collect(
        smol_client.generate([chat], SamplingParams(temperature=0, max_new_tokens=n + 5, ignore_eos=True))[0]
    )
    assert len(ign[0]) == n + 5 and ign[2].finish_reason is FinishReason.LENGTH


def test_counter_noise_depends_only_on_seed_step_token():
    seeds = torch.tensor([1, 2, 1, 2**62 + 3])
    steps = torch.tensor([0, 0, 1, 5])
    u = counter_uniform(seeds, steps, 1000)
    assert torch.equal(u[0], counter_uniform(seeds[:1], steps[:1], 1000)[0])
    assert not torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_noise_is_strictly_inside_the_unit_interval():
    """Regression: 24-bit uniforms rounded to 1.0, so -log(u) = 0 made 0/0 = NaN win the argmax."""
    u = counter_uniform(torch.arange(64), torch.arange(64), 49152)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0


def test_logit_bias_forces_bans_and_leaves_other_rows_alone(smol_client, hf_tokenizer):
    """logit_bias: +100 on a token makes greedy and sampling pick it; -100 on greedy's choice bans it
    (the next best comes instead); a row without a bias in the same batch is what it is alone."""
    prompt = hf_tokenizer.encode("Once upon a time")
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    plain = _ids(smol_client, prompt, greedy)
    forced_id = hf_tokenizer.encode(" banana")[0]
    forced = SamplingParams(**{**vars(greedy), "logit_bias": {forced_id: 100.0}})
    sampled = SamplingParams(
        temperature=1.0, seed=3, max_new_tokens=8, ignore_eos=True, logit_bias={forced_id: 100.0}
    )
    banned = SamplingParams(**{**vars(greedy), "logit_bias": {t: -100.0 for t in set(plain)}})
    outs = smol_client.generate([prompt] * 4, [forced, sampled, banned, greedy])
    got = [collect(o)[0] for o in outs]
    assert got[0] == [forced_id] * 8 and got[1] == [forced_id] * 8
    assert not set(got[2]) & set(plain) and len(got[2]) == 8
    assert got[3] == plain


def test_masked_tokens_are_never_sampled():
    vocab, bs = 49152, 64
    logits = torch.full((bs, vocab), float("-inf"))
    logits[:, 91] = 0.0
    logits[:, 4000] = 1.0
    ids = Sampler(bs, vocab).sample(logits, _sb(bs, top_ks=torch.full((bs,), vocab), need_top_k_p=False))
    assert set(ids.tolist()) <= {91, 4000}


@pytest.mark.parametrize(
    "penalty, edit, expected",
    [
        # vLLM's order: the bias is added, then the repetition penalty scales the sum (it was added
        # after, so the biased, penalised token won: 1/4 - 2 > -3, where (1 - 2) * 4 < -3)
        (4.0, "bias", 1),
        (None, "bias", 0),  # 1 - 2 > -3
        (4.0, "ban", 0),  # token 1 banned; the penalty makes a new tensor before the ban
    ],
)
def test_logit_bias_goes_before_the_penalties_and_edits_leave_the_logits(penalty, edit, expected):
    logits = torch.tensor([[1.0, -3.0, -10.0, -10.0]])
    before = logits.clone()
    s = Sampler(1, 4)
    s.prompt_mask[0, 0] = True  # token 0 is in the prompt: the repetition penalty applies
    kw = dict(all_greedy=True, need_penalties=penalty is not None)
    if penalty is not None:
        kw["repetition_penalties"] = torch.tensor([penalty])
    if edit == "bias":
        kw |= dict(
            bias_rows=torch.tensor([0]), bias_tokens=torch.tensor([0]), bias_values=torch.tensor([-2.0])
        )
    else:
        kw |= dict(banned_rows=torch.tensor([0]), banned_tokens=torch.tensor([1]))
    assert s.sample(logits, _sb(1, **kw)).tolist() == [expected]
    assert torch.equal(logits, before)  # the model's logits stay (logprobs read them)


def _sb(bs: int, **kw) -> SamplingBatch:
    base = dict(
        temperatures=torch.ones(bs),
        top_ks=torch.full((bs,), 8),
        top_ps=torch.ones(bs),
        min_ps=torch.zeros(bs),
        repetition_penalties=torch.ones(bs),
        frequency_penalties=torch.zeros(bs),
        presence_penalties=torch.zeros(bs),
        seeds=torch.arange(bs),
        steps=torch.zeros(bs, dtype=torch.int64),
        req_slots=torch.arange(bs),
        all_greedy=False,
        need_top_k_p=True,
        need_min_p=False,
        need_penalties=False,
    )
    base.update(kw)
    return SamplingBatch(**base)


def test_sampler_distribution_follows_top_k_and_top_p():
    vocab, bs = 8, 4000
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0, 0, 0])
    logits = torch.log(probs.clamp(min=1e-12)).repeat(bs, 1)
    s = Sampler(bs, vocab)
    ids = s.sample(logits, _sb(bs))
    freq = torch.bincount(ids, minlength=vocab).float() / bs
    assert torch.allclose(freq[:5], probs[:5], atol=0.03)
    ids = Sampler(bs, vocab).sample(logits, _sb(bs, top_ks=torch.full((bs,), 2)))
    assert set(ids.tolist()) == {0, 1}
    ids = Sampler(bs, vocab).sample(logits, _sb(bs, top_ps=torch.full((bs,), 0.6)))
    assert set(ids.tolist()) == {0, 1}  # 0.4 < 0.6 so the second token is needed, the third is not
