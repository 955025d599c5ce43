"""The opt-in kernel (analytic gradient, eager and compiled) against the formula."""

import dataclasses
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from packaging.version import Version

from trl_grpo_ext import grpo_loss
from trl_grpo_ext.ops import ObjectiveOptions, fused, policy_objective

OPTION_FIELDS = {field.name for field in dataclasses.fields(ObjectiveOptions)}


def batch(num_rows, num_tokens, *, seed, per_token_advantages=False, dtype=torch.float32, spread=0.3):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(num_rows, num_tokens, generator=generator) * 3
    old = logps + spread * torch.randn(num_rows, num_tokens, generator=generator)
    ref = logps + spread * torch.randn(num_rows, num_tokens, generator=generator)
    old[0, 0], ref[1, 0] = logps[0, 0] - 30.0, logps[1, 0] + 60.0  # beyond the linear threshold
    shape = (num_rows, num_tokens) if per_token_advantages else (num_rows,)
    advantages = torch.randn(shape, generator=generator)
    lengths = torch.randint(0, num_tokens + 1, (num_rows, 1), generator=generator)
    lengths[0], lengths[1] = num_tokens, num_tokens
    mask = (torch.arange(num_tokens)[None] < lengths).long()
    # garbage where masked, in every input
    for tensor in (logps, old, ref):
        tensor.masked_fill_(mask == 0, float("nan"))
    return [t.to(dtype) for t in (logps, old, ref, advantages)] + [mask]


def run(implementation, logps, old, ref, advantages, mask, **kwargs):
    leaf = logps.clone().requires_grad_(True)
    out = grpo_loss(leaf, old, ref, advantages, mask, implementation=implementation, **kwargs)
    out.loss.backward()
    return out, leaf.grad


def objective(logps, *args, **kwargs):
    """`policy_objective` with the loss type's options given by name among the other keyword arguments."""
    options = ObjectiveOptions(**{name: kwargs.pop(name) for name in list(kwargs) if name in OPTION_FIELDS})
    return policy_objective(logps, *args, options, **kwargs)


def run_objective(implementation, logps, *args, **kwargs):
    leaf = logps.clone().requires_grad_(True)
    out = objective(leaf, *args, implementation=implementation, **kwargs)
    out.loss.backward()
    return out, leaf.grad


def assert_same(out, grad, expected, expected_grad, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(out.loss, expected.loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.policy_loss, expected.policy_loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.kl, expected.kl, rtol=rtol, atol=atol)
    torch.testing.assert_close(grad, expected_grad, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.clip_units_per_row.float(), expected.clip_units_per_row.float())
    torch.testing.assert_close(out.low_clipped_per_row.float(), expected.low_clipped_per_row.float())
    torch.testing.assert_close(out.high_clipped_per_row.float(), expected.high_clipped_per_row.float())
    for name in ("ratio", "log_ratio", "per_token_kl", "is_low_clipped", "is_high_clipped", "mask"):
        torch.testing.assert_close(getattr(out, name), getattr(expected, name), rtol=rtol, atol=atol)


@pytest.mark.parametrize("per_token_advantages", [False, True])
@pytest.mark.parametrize("beta", [0.04, 0.0])
@pytest.mark.parametrize("seed", range(3))
def test_fused_agrees_with_the_reference(seed, beta, per_token_advantages):
    inputs = batch(9, 13, seed=seed, per_token_advantages=per_token_advantages)
    ref_logps = inputs[2] if beta > 0 else None
    expected, expected_grad = run(
        "reference", inputs[0], inputs[1], ref_logps, *inputs[3:], beta=beta, epsilon_high=0.28
    )
    out, grad = run("fused", inputs[0], inputs[1], ref_logps, *inputs[3:], beta=beta, epsilon_high=0.28)
    assert_same(out, grad, expected, expected_grad)
    assert math.isfinite(out.loss.item()) and torch.isfinite(grad).all()


def test_fused_on_policy_and_bfloat16_inputs():
    logps, _, ref, advantages, mask = batch(8, 11, seed=4, dtype=torch.bfloat16)
    expected, expected_grad = run("reference", logps, None, ref, advantages, mask)
    out, grad = run("fused", logps, None, ref, advantages, mask)
    assert grad.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    assert_same(out, grad, expected, expected_grad, rtol=1e-2, atol=1e-3)  # bf16 gradients round to 8 bits
    torch.testing.assert_close(out.loss, expected.loss)


def test_the_fused_backward_keeps_one_buffer_for_the_gradient():
    logps, old, ref, advantages, mask = batch(4, 6, seed=6)
    leaf = logps.clone().requires_grad_(True)
    loss = grpo_loss(leaf, old, ref, advantages, mask, implementation="fused").loss
    saved = [tensor for tensor in loss.grad_fn.saved_tensors if tensor.dim() == 2]
    assert len(saved) == 1 and saved[0].shape == logps.shape


def test_a_failing_compiler_falls_back_to_the_eager_kernel(monkeypatch):
    def broken_compile(function, **kwargs):
        def raises(*args, **kw):
            raise RuntimeError("no C++ compiler here")

        return raises

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(fused, "_compiled_terms", None)
    monkeypatch.setattr(fused, "_compile_failed", False)
    inputs = batch(5, 8, seed=7)
    expected, expected_grad = run("fused", *inputs)
    with pytest.warns(UserWarning, match="torch.compile of the GRPO loss failed .*no C\\+\\+ compiler here"):
        out, grad = run("compiled", *inputs)
    assert_same(out, grad, expected, expected_grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once; later calls go straight to the eager kernel
        run("compiled", *inputs)


@pytest.mark.slow
def test_compiled_agrees_with_the_reference_across_shapes(monkeypatch):
    monkeypatch.setattr(fused, "_compile_failed", False)
    for shape, seed in (((9, 13), 0), ((16, 40), 1), ((3, 7), 2)):  # dynamic shapes: one compilation
        inputs = batch(*shape, seed=seed)
        expected, expected_grad = run("reference", *inputs)
        out, grad = run("compiled", *inputs)
        assert_same(out, grad, expected, expected_grad, rtol=1e-4, atol=1e-5)


def test_a_second_backward_through_the_fused_loss_is_refused():
    inputs = batch(3, 5, seed=8)
    leaf = inputs[0].clone().requires_grad_(True)
    loss = grpo_loss(leaf, *inputs[1:], implementation="fused").loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run backward twice"):
        loss.backward()


# (epsilon, epsilon_high, beta): each call must use its own values, whatever was compiled before.
HYPERPARAMETERS = ((0.2, None, 0.04), (0.2, 0.28, 0.04), (0.1, 0.3, 0.0), (0.3, 0.1, 0.5))


@pytest.mark.slow
def test_compiled_uses_each_call_s_epsilons_and_beta(monkeypatch):
    monkeypatch.setattr(fused, "_compile_failed", False)
    inputs = batch(12, 20, seed=11, spread=0.5)  # wide ratios: each epsilon clips other tokens
    for epsilon, epsilon_high, beta in HYPERPARAMETERS:
        kwargs = dict(epsilon=epsilon, epsilon_high=epsilon_high, beta=beta)
        ref_logps = inputs[2] if beta > 0 else None
        expected, expected_grad = run("reference", inputs[0], inputs[1], ref_logps, *inputs[3:], **kwargs)
        out, grad = run("compiled", inputs[0], inputs[1], ref_logps, *inputs[3:], **kwargs)
        assert_same(out, grad, expected, expected_grad, rtol=1e-4, atol=1e-5)


_CACHE_RUN = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_ops_fused import batch, run
    epsilon, epsilon_high = float(sys.argv[1]), float(sys.argv[2])
    inputs = batch(12, 20, seed=11, spread=0.5)
    out, grad = run("compiled", *inputs, epsilon=epsilon, epsilon_high=epsilon_high)
    expected, expected_grad = run("reference", *inputs, epsilon=epsilon, epsilon_high=epsilon_high)
    print(out.loss.item(), expected.loss.item(), (grad - expected_grad).abs().max().item())
    """
)


#: The compiled kernel's memory and cache behaviour is inductor's, measured with torch 2.13 and 2.14: torch 2.11 (the
#: oldest the package admits) held 3.0 and 8.1 (N, T) buffers where those hold at most 1.5 and 6.0, and left the cache
#: folder of the test below empty (docs/compatibility.md). Its values are the reference's on every torch.
INDUCTOR_FIGURES = pytest.mark.skipif(
    Version(torch.__version__).release < (2, 13), reason="the compiled kernel's figures are torch 2.13's and later's"
)


@pytest.mark.slow
@INDUCTOR_FIGURES
def test_compiled_epsilons_survive_the_inductor_cache_of_an_earlier_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_CACHE_RUN.format(tests=os.path.dirname(__file__)))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TMPDIR": str(tmp_path)}
    for epsilon, epsilon_high in ((0.2, 0.2), (0.2, 0.28), (0.1, 0.3)):  # the first one fills the cache
        result = subprocess.run(
            [sys.executable, str(script), str(epsilon), str(epsilon_high)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        compiled_loss, reference_loss, grad_error = map(float, result.stdout.split()[-3:])
        assert compiled_loss == pytest.approx(reference_loss, rel=1e-5), (epsilon, epsilon_high)
        assert grad_error < 1e-5
    assert any((tmp_path / "inductor").iterdir())  # the later processes did have a cache to reuse


def test_the_fused_loss_refuses_a_second_derivative_and_the_reference_gives_it():
    inputs = batch(3, 5, seed=9)
    for implementation, second_order in (("fused", False), ("reference", True)):
        leaf = inputs[0].clone().requires_grad_(True)
        loss = grpo_loss(leaf, *inputs[1:], implementation=implementation).loss
        if second_order:
            (grad,) = torch.autograd.grad(loss, leaf, create_graph=True)
            (hessian_diagonal,) = torch.autograd.grad(grad.sum(), leaf)
            assert torch.isfinite(hessian_diagonal).all() and hessian_diagonal.abs().sum() > 0
        else:
            with pytest.raises(RuntimeError, match="first-order gradient only.*implementation='reference'"):
                torch.autograd.grad(loss, leaf, create_graph=True)


# What the kernel holds in memory, counted in `(N, T)` float32 buffers as `python -m benchmarks kernel` reports it
# (docs/performance.md), at the benchmark's shape. The gradient itself, one buffer, is part of every count.


def nt_buffers_at_peak(call, num_elements):
    """The most bytes `call()` holds at once beyond what was allocated before it, in `(N, T)` float32 buffers.

    From the profiler's allocation events, which see every CPU allocation: eager ops' and torch.compile's kernels'.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profiler:
        call()
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    assert events, "the profiler recorded no allocation"
    live = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak / (num_elements * 4)


@pytest.mark.parametrize(
    "implementation, most",
    [
        # Each returns the per-token values (3 float32 and 2 boolean (N, T) tensors) beside the gradient; autograd
        # through the formula keeps its intermediates for the backward pass (20.0 buffers measured), the kernel one
        # gradient (eager 9.75: its temporaries at their peak; compiled 6.75).
        ("reference", 20.5),
        ("fused", 10.0),
        pytest.param("compiled", 7.0, marks=INDUCTOR_FIGURES),
    ],
)
def test_forward_and_backward_hold_few_nt_buffers_at_their_peak(implementation, most, monkeypatch):
    monkeypatch.setattr(fused, "_compile_failed", False)
    logps, old, ref, advantages, mask = batch(64, 4096, seed=12)

    def forward_and_backward(leaf):
        out = policy_objective(leaf, old, ref, advantages, mask, implementation=implementation)
        out.loss.backward()

    forward_and_backward(logps.clone().requires_grad_(True))  # compilation, lazy initialisations
    leaf = logps.clone().requires_grad_(True)
    peak = nt_buffers_at_peak(lambda: forward_and_backward(leaf), logps.numel())
    assert peak <= most, f"{implementation} held {peak:.2f} (N, T) buffers at its peak"


def test_the_kernel_reads_nothing_on_the_host():
    from benchmarks.syncs import SyncCounter

    logps, old, ref, advantages, mask = batch(8, 16, seed=15)
    with SyncCounter("cpu") as counter:
        leaf = logps.clone().requires_grad_(True)
        policy_objective(leaf, old, ref, advantages, mask, implementation="fused").loss.backward()
    assert counter.total() == 0


@pytest.mark.parametrize("implementation", ["fused", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_keeps_one_nt_buffer_the_float32_gradient(implementation, dtype, monkeypatch):
    """The gradient is kept in the computation dtype and rounded to that of `logps` once, in backward, as autograd
    through the reference rounds it."""
    monkeypatch.setattr(fused, "_compile_failed", False)
    logps, old, ref, advantages, mask = batch(16, 64, seed=13, dtype=dtype)
    leaf = logps.clone().requires_grad_(True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = grpo_loss(leaf, old, ref, advantages, mask, implementation=implementation)
    per_token = [tensor for tensor in saved if tensor.numel() == logps.numel()]
    assert [(tuple(t.shape), t.dtype) for t in per_token] == [(tuple(logps.shape), torch.float32)]
    assert all(tensor.numel() <= logps.shape[0] for tensor in saved if tensor.numel() != logps.numel())
    out.loss.backward()
    expected, expected_grad = run("reference", logps, old, ref, advantages, mask)
    assert leaf.grad.dtype == dtype
    torch.testing.assert_close(leaf.grad, expected_grad, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_the_compiled_kernel_compiles_one_graph_for_every_hyperparameter_value(monkeypatch):
    """Hyper-parameters are inputs of the compiled graph, not constants in it: new values of epsilon, epsilon_high,
    beta, the loss scale or the aggregation's denominator compile nothing new, and the kernel is one graph (no graph
    breaks). A counting backend instead of inductor: it sees every graph dynamo makes, in a fraction of the time."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    counter = CompileCounter()
    compile_with_inductor = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda function, **kwargs: compile_with_inductor(function, **{**kwargs, "backend": counter})
    )
    monkeypatch.setattr(fused, "_compiled_terms", None)
    monkeypatch.setattr(fused, "_compile_failed", False)
    graph_breaks = sum(counters["graph_break"].values())
    inputs = batch(12, 20, seed=11, spread=0.5)
    cases = [
        dict(epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, loss_type=loss_type, loss_scale=scale)
        for (epsilon, epsilon_high, beta), (loss_type, scale) in zip(
            HYPERPARAMETERS * 2, [("grpo", 1.0), ("bnpo", 0.5), ("dr_grpo", 0.25), ("luspo", 1.0)] * 2, strict=True
        )
    ]
    for kwargs in cases:
        kwargs["denominator"] = 7.0 * (1 + kwargs["beta"])
        leaf = inputs[0].clone().requires_grad_(True)
        out = objective(leaf, *inputs[1:], implementation="compiled", **kwargs)
        out.loss.backward()
        expected, expected_grad = run_objective("reference", *inputs, **kwargs)
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(leaf.grad, expected_grad, rtol=1e-4, atol=1e-6)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled for {len(cases)} sets of values"
    assert sum(counters["graph_break"].values()) == graph_breaks


@pytest.mark.parametrize("where", ["logps", "old_logps"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_a_log_ratio_of_minus_infinity_gives_one_loss_on_every_path(where, beta):
    """A token whose log ratio is -inf (its log-prob -inf: it lost all its probability, or an old log-prob of +inf)
    has a ratio of exactly 0, `exp`'s value there and TRL's: the clipped term is finite on every path (the formula,
    the kernel, eager and compiled), with a finite gradient. With `beta > 0`
    a log-prob of -inf makes the KL term infinite on every path alike (bad input is not repaired), never NaN."""
    logps, old, ref, advantages, mask = batch(6, 5, seed=21)
    mask = torch.ones_like(mask)
    logps, old, ref = (torch.nan_to_num(tensor, nan=-1.0) for tensor in (logps, old, ref))
    old[0, 0], ref[1, 0] = logps[0, 0], logps[1, 0]  # every other exponent below the tangent: TRL's plain exp below
    advantages[2], advantages[3] = 1.0, -1.0  # both signs: clip(0, l, u) is 0 for A > 0, 1 - eps for A < 0
    for row in (2, 3):
        if where == "logps":
            logps[row, 1] = -math.inf
        else:
            old[row, 1] = math.inf
    losses = {}
    for implementation in ("reference", "fused", "compiled"):
        out, grad = run(implementation, logps, old, ref if beta else None, advantages, mask, beta=beta)
        losses[implementation] = out.loss.item()
        assert grad.isfinite().all(), implementation
        assert out.policy_loss.isfinite(), implementation
    kl_on = beta > 0 and where == "logps"  # D = ref - logp = +inf
    expected = math.inf if kl_on else pytest.approx(losses["reference"])
    assert all(loss == expected for loss in losses.values()), losses
    assert math.isfinite(losses["reference"]) != kl_on
    # the value: the ratio 0 where the log ratio is -inf, and TRL's formula everywhere else
    if not kl_on:
        ratio = torch.exp(logps - old)
        clipped = ratio.clamp(0.8, 1.2)
        per_token = -torch.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
        if beta:
            d = ref - logps
            per_token = per_token + beta * (torch.exp(d) - d - 1)
        assert losses["reference"] == pytest.approx(per_token.mean(dim=1).mean().item(), rel=1e-5)
