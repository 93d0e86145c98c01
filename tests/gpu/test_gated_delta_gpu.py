"""The Gated DeltaNet Triton kernels vs their references on a GPU at Qwen3.5-397B-A17B's linear-attention dims
(16 key heads x 128, 64 value heads x 128, conv width 4: 12288 conv channels), bf16 activations over fp32 states;
the decode step and the conv update also inside a captured CUDA graph; the chunked prefill over a ragged batch and
one long prompt; in-step state snapshots (hybrid prefix caching) from both prefill kernels; and a tiny Qwen3-Next
served with decode graphs (state slots as static inputs) against eager."""

import pytest
import torch

# Skip before importing the kernels: on a CPU-only run, importing triton here (before tests/kernels' conftest turns
# the interpreter on) would leave the interpreted CPU kernel tests unable to run.
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gyrfalcon.kernels.gated_delta import (causal_conv1d_ref, causal_conv1d_triton,  # noqa: E402
                                           causal_conv1d_update_ref, causal_conv1d_update_triton,
                                           gated_delta_decode_ref, gated_delta_decode_triton,
                                           gated_delta_prefill_ref, gated_delta_prefill_triton, gated_rms_norm_ref,
                                           gated_rms_norm_triton, save_table, state_saves_from_table)

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
BF16 = torch.bfloat16
TOL = dict(atol=2e-2, rtol=2e-2)
STATE_TOL = dict(atol=1e-4, rtol=1e-4)
# The chunked prefill's dots run in TF32 (gated_delta.configs.CHUNK_DOT_PRECISION), the reference's in fp32.
PREFILL_STATE_TOL = dict(atol=1e-2, rtol=1e-2)
H, HV, DK, DV, K = 16, 64, 128, 128, 4
KEY_DIM, VALUE_DIM = H * DK, HV * DV
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
NUM_SLOTS = 80


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _slots_and_init(B):
    """B distinct slots out of order, every third sequence at position 0 (its slot NaN: it must start from zeros)."""
    slots = torch.randperm(NUM_SLOTS, device=DEV)[:B].to(torch.int32)
    init = torch.arange(B, device=DEV) % 3 != 1
    return slots, init


def _poison(pool, slots, init):
    pool[slots[~init].long()] = float("nan")
    return pool


def _projection(T):
    """The layer's in_proj_qkvz output [T, conv | z] and in_proj_ba's [T, b | a], bf16: q / k / v / z / a / b are
    strided slices of them, as the layer passes them."""
    qkvz = torch.randn(T, CONV_DIM + VALUE_DIM, device=DEV, dtype=BF16)
    ba = (2 * torch.randn(T, 2 * HV, device=DEV)).to(BF16)
    return qkvz, ba


def _qkv_ab(qkvz, ba):
    T = qkvz.shape[0]
    mixed = qkvz[:, :CONV_DIM]
    q, k, v = mixed.split([KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
    b, a = ba.split([HV, HV], dim=-1)
    return q.reshape(T, H, DK), k.reshape(T, H, DK), v.reshape(T, HV, DV), a, b


def _gating_params():
    return torch.rand(HV, device=DEV).clamp_min(0.05).log(), torch.randn(HV, device=DEV)


@pytest.mark.parametrize("B", [1, 8, 64])
def test_decode_step_real_dims(B):
    slots, init = _slots_and_init(B)
    q, k, v, a, b = _qkv_ab(*_projection(B))
    A_log, dt_bias = _gating_params()
    pool = _poison(0.05 * torch.randn(NUM_SLOTS, HV, DK, DV, device=DEV), slots, init)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gated_delta_decode_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, init)
    got = gated_delta_decode_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, init)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got_pool.isnan(), want_pool.isnan())
    torch.testing.assert_close(got_pool.nan_to_num(0.0), want_pool.nan_to_num(0.0), **STATE_TOL)


def test_decode_step_and_conv_update_in_a_cuda_graph():
    """The conv update and the decode step captured once and replayed over new tokens in the same static buffers:
    no host sync inside, and each replay reads the state the previous one wrote."""
    B = 4
    slots, init = _slots_and_init(B)
    init = torch.ones_like(init)
    A_log, dt_bias = _gating_params()
    w = torch.randn(CONV_DIM, K, device=DEV, dtype=BF16)
    conv0 = torch.randn(NUM_SLOTS, K - 1, CONV_DIM, device=DEV, dtype=BF16)
    pool0 = 0.05 * torch.randn(NUM_SLOTS, HV, DK, DV, device=DEV)
    qkvz, ba = _projection(B)
    conv, pool = conv0.clone(), pool0.clone()

    def step():
        mixed = causal_conv1d_update_triton(qkvz[:, :CONV_DIM], w, conv, slots, init)
        q, k, v = mixed.split([KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
        b, a = ba.split([HV, HV], dim=-1)
        return mixed, gated_delta_decode_triton(q.reshape(B, H, DK), k.reshape(B, H, DK), v.reshape(B, HV, DV), a,
                                                b, A_log, dt_bias, pool, slots, init)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mixed, out = step()
    conv.copy_(conv0)
    pool.copy_(pool0)
    want_conv, want_pool = conv0.clone(), pool0.clone()
    for _ in range(3):
        new_qkvz, new_ba = _projection(B)
        qkvz.copy_(new_qkvz)
        ba.copy_(new_ba)
        graph.replay()
        want_mixed = causal_conv1d_update_ref(new_qkvz[:, :CONV_DIM], w, want_conv, slots, init)
        torch.testing.assert_close(mixed, want_mixed, **TOL)
        # The reference step reads the graph's conv output: bf16 rounding differences of the conv stay out of the
        # states compared below.
        q, k, v = mixed.split([KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
        b, a = new_ba.split([HV, HV], dim=-1)
        want = gated_delta_decode_ref(q.reshape(B, H, DK), k.reshape(B, H, DK), v.reshape(B, HV, DV), a, b, A_log,
                                      dt_bias, want_pool, slots, init)
        torch.testing.assert_close(out, want, **TOL)
    assert torch.equal(conv, want_conv)  # windows are copies of the inputs
    torch.testing.assert_close(pool, want_pool, **STATE_TOL)


@pytest.mark.parametrize("lens", [[1000, 1, 0, 64, 257], [4100]], ids=["ragged", "one-prompt"])
def test_prefill_real_dims(lens):
    """Chunks of any length (a multiple of 64, one token, none) and one long prompt, slots out of order, every
    third sequence starting from zeros (its slot NaN), the rest continuing from their slots' states."""
    B, T = len(lens), sum(lens)
    slots, init = _slots_and_init(B)
    qsl = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    q, k, v, a, b = _qkv_ab(*_projection(T))
    A_log, dt_bias = _gating_params()
    pool = _poison(0.05 * torch.randn(NUM_SLOTS, HV, DK, DV, device=DEV), slots, init)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, qsl, init)
    got = gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, qsl, init)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got_pool.isnan(), want_pool.isnan())
    torch.testing.assert_close(got_pool.nan_to_num(0.0), want_pool.nan_to_num(0.0), **PREFILL_STATE_TOL)


def _saves_every(lens, stride, first_id=0):
    """StateSaves after every `stride`-th token of each chunk (and its first two: windows still partly from the
    slot), ids in order -> (saves, number of saves)."""
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    triples = [(i, qsl[i] + t, 0) for i, n in enumerate(lens) for t in sorted({0, 1, *range(stride - 1, n, stride)})
               if t < n]
    triples = [(i, row, first_id + j) for j, (i, row, _) in enumerate(triples)]
    table = save_table(triples, torch.tensor(qsl).numpy())
    return state_saves_from_table(torch.from_numpy(table).to(DEV), len(lens), len(triples)), len(triples)


@pytest.mark.parametrize("lens", [[1000, 1, 0, 64, 257], [4100]], ids=["ragged", "one-prompt"])
def test_prefill_saves_real_dims(lens):
    """In-step snapshots every 16 tokens (block boundaries inside and at the ends of 64-token chunks) at real dims:
    the kernel's states against the reference's, and the step's outputs and final states exactly as without saves."""
    B, T = len(lens), sum(lens)
    slots, init = _slots_and_init(B)
    qsl = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    q, k, v, a, b = _qkv_ab(*_projection(T))
    A_log, dt_bias = _gating_params()
    saves, n = _saves_every(lens, 16)
    pool = _poison(0.05 * torch.randn(NUM_SLOTS, HV, DK, DV, device=DEV), slots, init)
    want_pool, got_pool, plain_pool = pool.clone(), pool.clone(), pool.clone()
    want_snaps = torch.full((n, HV, DK, DV), float("nan"), device=DEV)
    got_snaps = want_snaps.clone()
    gated_delta_prefill_ref(q, k, v, a, b, A_log, dt_bias, want_pool, slots, qsl, init, want_snaps, saves)
    got = gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, got_pool, slots, qsl, init, got_snaps, saves)
    plain = gated_delta_prefill_triton(q, k, v, a, b, A_log, dt_bias, plain_pool, slots, qsl, init)
    assert torch.equal(got, plain)
    assert torch.equal(got_pool.nan_to_num(0.0), plain_pool.nan_to_num(0.0))
    assert not got_snaps.isnan().any()
    torch.testing.assert_close(got_snaps, want_snaps, **PREFILL_STATE_TOL)


@pytest.mark.parametrize("lens", [[1000, 1, 0, 3, 257], [4096]], ids=["ragged", "one-prompt"])
def test_conv_saves_real_dims(lens):
    B = len(lens)
    slots, init = _slots_and_init(B)
    qsl = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    x = _projection(sum(lens))[0][:, :CONV_DIM]
    w = torch.randn(CONV_DIM, K, device=DEV, dtype=BF16)
    saves, n = _saves_every(lens, 16)
    pool = _poison(torch.randn(NUM_SLOTS, K - 1, CONV_DIM, device=DEV, dtype=BF16), slots, init)
    want_pool, got_pool = pool.clone(), pool.clone()
    want_snaps = torch.zeros(n, K - 1, CONV_DIM, device=DEV, dtype=BF16)
    got_snaps = want_snaps.clone()
    causal_conv1d_ref(x, w, want_pool, slots, qsl, init, want_snaps, saves)
    causal_conv1d_triton(x, w, got_pool, slots, qsl, init, got_snaps, saves)
    assert torch.equal(got_snaps, want_snaps)  # windows are copies of the inputs
    assert torch.equal(got_pool.nan_to_num(0.0), want_pool.nan_to_num(0.0))


@pytest.mark.parametrize("B", [1, 64])
def test_conv_update_real_dims(B):
    slots, init = _slots_and_init(B)
    x = _projection(B)[0][:, :CONV_DIM]
    w = torch.randn(CONV_DIM, 1, K, device=DEV, dtype=BF16).squeeze(1)
    pool = _poison(torch.randn(NUM_SLOTS, K - 1, CONV_DIM, device=DEV, dtype=BF16), slots, init)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = causal_conv1d_update_ref(x, w, want_pool, slots, init)
    got = causal_conv1d_update_triton(x, w, got_pool, slots, init)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got_pool.isnan(), want_pool.isnan())
    assert torch.equal(got_pool.nan_to_num(0.0), want_pool.nan_to_num(0.0))


@pytest.mark.parametrize("lens", [[1000, 1, 0, 3, 257], [4096]], ids=["ragged", "one-prompt"])
def test_conv_prefill_real_dims(lens):
    B = len(lens)
    slots, init = _slots_and_init(B)
    qsl = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    x = _projection(sum(lens))[0][:, :CONV_DIM]
    w = torch.randn(CONV_DIM, K, device=DEV, dtype=BF16)
    pool = _poison(torch.randn(NUM_SLOTS, K - 1, CONV_DIM, device=DEV, dtype=BF16), slots, init)
    want_pool, got_pool = pool.clone(), pool.clone()
    want = causal_conv1d_ref(x, w, want_pool, slots, qsl, init)
    got = causal_conv1d_triton(x, w, got_pool, slots, qsl, init)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got_pool.isnan(), want_pool.isnan())
    assert torch.equal(got_pool.nan_to_num(0.0), want_pool.nan_to_num(0.0))


def test_gated_rms_norm_real_dims():
    T = 1000
    qkvz, _ = _projection(T)
    z = qkvz[:, CONV_DIM:].reshape(T, HV, DV)  # a strided view, as the layer passes it
    o = torch.randn(T, HV, DV, device=DEV, dtype=BF16)
    w = (1 + 0.1 * torch.randn(DV, device=DEV)).to(BF16)
    torch.testing.assert_close(gated_rms_norm_triton(o, z, w, 1e-6), gated_rms_norm_ref(o, z, w, 1e-6), **TOL)


def test_qwen3_next_decode_graphs_match_eager(tmp_path):
    """A tiny Qwen3-Next (fp32) with its decode steps replayed as CUDA graphs (each row's state slot a static input,
    padding rows on the spare slot; prefills eager) and with every step eager: the same greedy tokens, batches padded
    up the ladder, a second round restoring prefix-cache snapshots before its graph-replayed decode steps."""
    from checkpoints import make_qwen3_next_checkpoint

    from gyrfalcon import LLM, SamplingParams

    path = make_qwen3_next_checkpoint(tmp_path / "qwen3_next")
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((1, 9, 70, 33, 140))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(str(path), dtype="float32", block_size=16, max_num_seqs=8, enforce_eager=eager)
        runner = llm.engine.runner
        assert (runner.graph_runner is None) == eager and runner.mixed_graph_runner is None
        replays = []
        if not eager:
            run = runner.graph_runner.run
            runner.graph_runner.run = lambda reqs, rows=None: replays.append(len(reqs)) or run(reqs, rows)
        rounds = []
        for _ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            rounds.append(([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]))
        if not eager:
            assert 5 in replays  # decode steps of the whole batch, padded to 8 rows
        results[eager] = rounds
        del llm, runner
        torch.cuda.empty_cache()
    assert results[False] == results[True]
    (tokens1, cached1), (tokens2, cached2) = results[False]
    assert tokens1 == tokens2 and cached1 == [0] * 5 and cached2 == [(len(p) - 1) // 16 * 16 for p in prompts]
