"""Knowledge distillation of a dense student from its teacher (paper §3.5, §4.3–4.4, Appendix J).

A readable nanoGPT-style loop in plain PyTorch: AdamW, linear warmup then cosine decay to min_lr,
gradient accumulation, gradient clipping, bf16 autocast on GPU (fp32 master weights) / fp32 on CPU.
The teacher is frozen (eval, no_grad); with ``teacher_top_k`` = k′ its MoE layers route every token to
their top-k′ experts while producing the KD targets (Eq. 6), through the family adapter's
``routing_top_k`` context manager: nothing is copied. Losses come from ``workers.training.losses`` by name and
are computed from the final hidden states, chunk by chunk through the LM head, so [tokens, vocab]
logits are never built for a whole micro-batch.

The same loop serves the multi-process paths (``workers.training.ddp``, ``workers.training.fsdp``): ``train_loop`` takes the
module to run forward through (DDP-wrapped or FSDP-sharded there) and a ``Ranks`` object that shards
batches and reduces numbers.

Speed settings (DistillSpec): ``compile`` runs every decoder layer of student and teacher through one
``torch.compile``d function per layer class (regional compilation: one layer's compile time, the code shared
by every layer of the class and every later model of it in the process); FSDP's hooks stay outside the
compiled forward and the activation checkpoint inside it; the KD loss's per-chunk divergence and gradient
run compiled too (losses, impl="compiled"). ``grad_checkpoint`` is off, on (recompute each
student layer in backward) or "selective" (keep the matmul and attention outputs, recompute the elementwise
ops between them). AdamW is the fused kernel on CUDA. Each micro-step's phases are timed (`PhaseTimer`) and
logged every ``eval_every`` steps.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from workers.core.schedule import cosine_lr
from workers.core.steplog import StepLog
from workers.models.decoder import decoder_of
from workers.models.head import logit_factor, output_head
from workers.training.distill_spec import DTYPES, DistillSpec  # noqa: F401  (re-exported)
from workers.training.losses import LOSSES, KDLoss, head_cross_entropy, head_divergence, hidden_mse
from workers.training.ranks import Ranks


def lr_at(step: int, spec: DistillSpec) -> float:
    """Linear warmup over `warmup` steps to lr, then cosine decay reaching min_lr at the last step."""
    return cosine_lr(step, spec.steps, spec.lr, spec.warmup, spec.min_lr)


def amp_dtype(spec: DistillSpec, device: torch.device) -> torch.dtype | None:
    """The autocast dtype (None = plain fp32)."""
    if spec.dtype == "bf16" or (spec.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


class ScaledHead(NamedTuple):
    """An output projection with the model's constant logit factor folded in: logits = weight·h + bias."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def lm_head(model: nn.Module) -> nn.Linear | ScaledHead:
    """The output projection, with the model's constant logit factor (workers.models.head.logit_factor) folded
    into its weight and bias (the student's stays differentiable); refuses models whose logits are more than
    that (a softcap)."""
    projection = model.get_output_embeddings()
    if not isinstance(projection, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}: output embeddings are {type(projection).__name__}, expected nn.Linear"
        )
    head = output_head(model)
    if head is not None and head.cap not in (None, 1.0):
        raise ValueError(
            f"{type(model).__name__}: config.final_logit_softcapping is set; the chunked KD loss "
            "supports a linear lm_head"
        )
    factor = 1.0 if head is None else logit_factor(head)
    if factor == 1.0:
        return projection
    return ScaledHead(
        projection.weight * factor, None if projection.bias is None else projection.bias * factor
    )


def base_forward(
    model: nn.Module, ids: torch.Tensor, hidden: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(final hidden states [B, T, H], every decoder layer's output (if `hidden`)) without the LM head."""
    out = decoder_of(model)(input_ids=ids, output_hidden_states=hidden, use_cache=False)
    return out.last_hidden_state, (list(out.hidden_states[1:]) if hidden else [])


class KDStudent(nn.Module):
    """The student and its distillation loss as one module, so DDP sees the whole forward pass."""

    def __init__(self, student: nn.Module, loss: KDLoss, tau: float, hidden_weight: float, chunk: int):
        super().__init__()
        self.student = student
        self.kd = loss
        self.tau = tau
        self.hidden_weight = hidden_weight
        self.chunk = chunk
        # set by train_loop while it trains: marks the end of the student's forward and of the loss, and
        # whether the loss's elementwise arithmetic runs compiled (with the layers: `compile_on`)
        self.timer: PhaseTimer | None = None
        self.loss_impl = "fused"

    def forward(
        self,
        ids: torch.Tensor,
        t_last: torch.Tensor | None = None,
        t_head: torch.Tensor | None = None,
        t_hidden: list[torch.Tensor] | None = None,
        t_bias: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, int]:
        """The KD loss; without teacher states, (Σ NLL, tokens) of next-token prediction where `mask` [B, T−1]
        is true: validation through this module, since a sharded root has its parameters only in forward."""
        if t_last is None:
            h, _ = base_forward(self.student, ids, False)
            head = lm_head(self.student)
            return head_cross_entropy(
                h[:, :-1], head.weight, ids[:, 1:], mask=mask, chunk=self.chunk, bias=head.bias
            )
        s_last, s_hidden = base_forward(self.student, ids, self.kd.uses_hidden)
        if self.timer is not None:
            self.timer.mark("student_fwd")
        head = lm_head(self.student)
        loss = head_divergence(
            self.kd.token_loss,
            t_last,
            t_head,
            s_last,
            head.weight,
            self.tau,
            chunk=self.chunk,
            teacher_bias=t_bias,
            student_bias=head.bias,
            impl=self.loss_impl,
        )
        if self.kd.uses_hidden:  # intermediate loss (§3.5, Minitron)
            loss = loss + self.hidden_weight * hidden_mse(t_hidden, s_hidden)
        if self.timer is not None:
            self.timer.mark("loss")
        return loss


# ---- ranks: one process, or one of several (workers.training.ddp) ------------------------------------------


@torch.no_grad()
def val_ce(
    model: nn.Module,
    val: torch.Tensor,
    batch_size: int,
    chunk: int,
    amp: torch.dtype | None,
    ranks: Ranks = Ranks(),
    through: nn.Module | None = None,
) -> float:
    """Mean next-token cross-entropy (nats/token) over the validation windows [n, T]; `through` is a
    KDStudent(model) (or its sharded root) to run the windows through instead of `model` itself."""
    head = lm_head(model)
    device = (
        head.weight.device
    )  # where the model computes (a teacher offloaded by FSDP keeps its shards on the CPU)
    was_training = model.training
    model.eval()
    rows, real = ranks.val_rows(val)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, rows.shape[0], batch_size):
        ids = rows[i : i + batch_size].to(device)
        mask = (
            None if real is None else real[i : i + batch_size, None].expand(-1, ids.shape[1] - 1).to(device)
        )
        with _autocast(amp, device):
            if through is not None:
                s, n = through(ids, mask=mask)
            else:
                h, _ = base_forward(model, ids, False)
                s, n = head_cross_entropy(
                    h[:, :-1], head.weight, ids[:, 1:], mask=mask, chunk=chunk, bias=head.bias
                )
        total += s.double()
        count += n
    model.train(was_training)
    total, count = ranks.sum(total), ranks.sum(count)
    return float(total / count.clamp(min=1))


def _teacher_routing(teacher: nn.Module, adapter: Any, spec: DistillSpec) -> dict[str, Any] | None:
    if spec.teacher_top_k is None:
        return None
    if adapter is None:
        raise ValueError("DistillSpec.teacher_top_k: expanded routing needs an MoE teacher (adapter is None)")
    n_exp = adapter.num_experts(teacher)
    if spec.teacher_top_k > n_exp:
        raise ValueError(
            f"DistillSpec.teacher_top_k: {spec.teacher_top_k} is not allowed; allowed: 1..{n_exp}"
        )
    renorm = adapter.renormalized(teacher) if spec.teacher_renormalize is None else spec.teacher_renormalize
    return {"top_k": spec.teacher_top_k, "renormalize": bool(renorm), "native_top_k": adapter.top_k(teacher)}


def _routing(teacher: nn.Module, adapter: Any, routing: dict | None) -> contextlib.AbstractContextManager:
    if routing is None:
        return contextlib.nullcontext()
    return adapter.routing_top_k(teacher, routing["top_k"], routing["renormalize"])


def _check_intermediate(student: nn.Module, teacher: nn.Module) -> None:
    sc, tc = student.config, teacher.config
    for key in ("num_hidden_layers", "hidden_size"):
        if getattr(sc, key, None) != getattr(tc, key, None):
            raise ValueError(
                f"DistillSpec.loss: 'intermediate' needs equal {key} in student and teacher "
                f"({getattr(sc, key, None)} vs {getattr(tc, key, None)})"
            )


# ---- activation checkpointing: off, whole layers, or selective ------------------------------------------
_aten = torch.ops.aten
SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten._grouped_mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing policy: keep what a matmul or attention kernel produced, recompute the rest
    (norms, activations, rotary, residual adds: cheap elementwise work, most of a layer's saved bytes)."""
    # selective activation recomputation: Korthikanti et al. 2022 (arXiv:2205.05198), §5
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, save_matmuls)


def _checkpointing(model: nn.Module, mode: bool | str) -> None:
    """HF activation checkpointing of the decoder layers (non-reentrant: works under DDP and FSDP, and inside
    a compiled layer): False off, True whole layers, "selective" through `save_matmuls`."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _SELECTIVE
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        if mode:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.activation_checkpointing_disable()
    elif mode:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


# ---- regional compilation --------------------------------------------------------------------------------
COMPILE_BACKEND = "inductor"
# compiled variants kept per layer class: grad mode × train/eval × routing × a validation tail's shape
COMPILE_RECOMPILES = 16
_COMPILED: dict[tuple[type, str], Callable[..., Any]] = {}  # (layer class, backend) -> its compiled forward


def compile_on(spec: DistillSpec, device: torch.device) -> bool:
    """Whether `spec.compile` compiles on this device: auto = on CUDA only."""
    if spec.compile == "auto":
        return device.type == "cuda"
    return bool(spec.compile)


def compiled_forward(cls: type, backend: str) -> Callable[..., Any]:
    """`cls.forward` through torch.compile, built once per (layer class, backend) for the process.

    Dynamo keeps compiled code and its recompile limit per code object; transformers wraps every layer
    class's forward in one shared function (its checkpointing wrapper), so the entry is a small function
    with a code object of its own per class. `self` is an argument and, with dynamo inlining built-in
    nn.Modules, parameters are graph inputs guarded on shape, dtype and device, not identity: every layer of
    a model, and every later model of the class, reuse the code. The checkpointing wrapper runs inside, so
    a checkpointed layer is compiled with its recomputation; module hooks (FSDP's gathers) stay outside."""
    key = (cls, backend)
    fn = _COMPILED.get(key)
    if fn is None:
        forward = cls.forward

        def entry(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return forward(self, *args, **kwargs)

        name = f"{cls.__name__}_distill_forward"
        code = entry.__code__.replace(co_name=name, co_qualname=name)
        fn = torch.compile(
            types.FunctionType(code, entry.__globals__, name, None, entry.__closure__),
            backend=backend,
            dynamic=False,
            recompile_limit=COMPILE_RECOMPILES,
        )
        _COMPILED[key] = fn
    return fn


def layer_list(model: nn.Module) -> nn.ModuleList | None:
    """The decoder's longest module list (its layers: `layers`, DBRX's `blocks`); None without one."""
    lists = [m for m in decoder_of(model).children() if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, key=len) if lists else None


@contextlib.contextmanager
def compiled_layers(model: nn.Module, on: bool = True, backend: str | None = None) -> Iterator[int]:
    """While open (and `on`), each decoder layer runs its class's compiled forward (`compiled_forward`);
    yields how many do. A layer whose forward is already an instance attribute (a hook framework's) stays
    as it is; on exit every layer gets its class's forward back."""
    swapped = []
    if on:
        for layer in layer_list(model) or []:
            if "forward" not in vars(layer):
                fn = compiled_forward(type(layer), backend or COMPILE_BACKEND)
                layer.forward = types.MethodType(fn, layer)
                swapped.append(layer)
    try:
        yield len(swapped)
    finally:
        for layer in swapped:
            del layer.forward


def fused_adamw(params: list[torch.Tensor]) -> bool:
    """Whether AdamW runs as the fused kernel: every parameter floating and on CUDA."""
    return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)


def make_optimizer(student: nn.Module, spec: DistillSpec) -> torch.optim.AdamW:
    """AdamW (Table 9); weight decay on matrices only, not on norms and biases (nanoGPT convention); the
    fused kernel on CUDA (one launch for every tensor's update)."""
    params = [p for p in student.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, fused=fused_adamw(params) or None)


# ---- the micro-step by parts ----------------------------------------------------------------------------
PHASES = ("teacher", "student_fwd", "loss", "backward", "optimizer", "comm")
STEP_PHASES = frozenset({"optimizer", "comm"})  # once per optimizer step


class PhaseTimer:
    """Wall time of the phases of the distillation micro-steps: CUDA events on CUDA (recorded on the
    compute stream and read at `summary`, so timing adds no synchronisation to a step), perf_counter on
    the CPU (where ops return when done). A micro-step is `start`, then `mark(phase)` at the end of each
    phase: teacher forward, student forward, loss (chunked LM head and KD loss, with the head's gradients
    where the loss computes them in its forward), backward; then once per optimizer step the optimizer
    (clipping, with its norm's reduction across ranks, AdamW, zero_grad) and comm (the loop's reduction of
    the step loss across ranks). FSDP's gathers and reduce-scatters and DDP's all-reduce run inside
    forward and backward: what of them the compute waits for counts there."""

    def __init__(self, device: torch.device, grad_accum: int) -> None:
        self.cuda = device.type == "cuda"
        self.grad_accum = grad_accum
        self.marks: list[tuple[str | None, Any]] = []

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks.append((None, self._now()))

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self._now()))

    def summary(self) -> dict[str, float]:
        """Milliseconds per micro-step of each phase since the last summary: the median over micro-steps
        (over optimizer steps ÷ grad_accum for optimizer and comm, which run once a step), so a first call
        that compiles does not count; `time_<phase>_ms` keys, then the marks are cleared."""
        if self.cuda and self.marks:
            self.marks[-1][1].synchronize()
        spans: dict[str, list[float]] = {p: [] for p in PHASES}
        for (_, a), (phase, b) in zip(self.marks, self.marks[1:], strict=False):
            if phase is not None:
                spans[phase].append(a.elapsed_time(b) if self.cuda else 1e3 * (b - a))
        self.marks = []
        out = {}
        for p in PHASES:
            ms = statistics.median(spans[p]) if spans[p] else 0.0
            out[f"time_{p}_ms"] = round(ms / (self.grad_accum if p in STEP_PHASES else 1), 3)
        return out


def _next_batch(it: Iterator[torch.Tensor], i: int, spec: DistillSpec) -> torch.Tensor:
    try:
        ids = next(it)
    except StopIteration:
        raise ValueError(
            f"batches: ran out after {i} micro-batches; the budget needs steps × grad_accum = "
            f"{spec.steps * spec.grad_accum}"
        ) from None
    if tuple(ids.shape) != (spec.batch_size, spec.seq_len):
        raise ValueError(
            f"batches: micro-batch {i} has shape {tuple(ids.shape)}; expected [batch_size, seq_len] = "
            f"[{spec.batch_size}, {spec.seq_len}]"
        )
    return ids


def train_loop(
    student: nn.Module,
    forward_module: nn.Module,
    teacher: nn.Module,
    adapter: Any,
    batches: Iterable[torch.Tensor],
    val: torch.Tensor,
    spec: DistillSpec,
    progress: Callable[[int, int], None] | None = None,
    on_val: Callable[[dict[str, Any]], None] | None = None,
    ranks: Ranks = Ranks(),
) -> dict[str, Any]:
    """The loop behind `distill` and `workers.training.ddp`: `forward_module` wraps KDStudent(student) (or is it).
    Student and teacher layers run compiled while it runs if `spec.compile` says so (`compile_on`)."""
    device = next(student.parameters()).device
    on = compile_on(spec, device)
    with compiled_layers(teacher, on), compiled_layers(student, on):
        return _train(student, forward_module, teacher, adapter, batches, val, spec, progress, on_val, ranks)


def _train(
    student: nn.Module,
    forward_module: nn.Module,
    teacher: nn.Module,
    adapter: Any,
    batches: Iterable[torch.Tensor],
    val: torch.Tensor,
    spec: DistillSpec,
    progress: Callable[[int, int], None] | None,
    on_val: Callable[[dict[str, Any]], None] | None,
    ranks: Ranks,
) -> dict[str, Any]:
    device = next(student.parameters()).device
    amp = amp_dtype(spec, device)
    kd = LOSSES[spec.loss]
    if kd.uses_hidden:
        _check_intermediate(student, teacher)
    routing = _teacher_routing(teacher, adapter, spec)
    teacher.eval()
    t_head = lm_head(teacher)
    records: list[dict[str, Any]] = []

    def record(value: float, who: str, step: int) -> None:
        rec = {"value": value, "who": who, "step": step, "tokens": step * spec.tokens_per_step}
        records.append(rec)
        if on_val is not None:
            on_val(rec)

    # the teacher's validation CE, once (its native routing, and the expanded one used for the targets)
    teacher_ce = {"teacher": val_ce(teacher, val, spec.batch_size, spec.logit_chunk, amp, ranks)}
    if routing is not None:
        with _routing(teacher, adapter, routing):
            teacher_ce[f"teacher_k{routing['top_k']}"] = val_ce(
                teacher, val, spec.batch_size, spec.logit_chunk, amp, ranks
            )

    through = forward_module if ranks.collective_forward else None

    def evaluate(step: int) -> None:
        record(val_ce(student, val, spec.batch_size, spec.logit_chunk, amp, ranks, through), "student", step)
        for who, value in teacher_ce.items():  # same steps, so the curves can be drawn side by side
            record(value, who, step)

    torch.manual_seed(spec.seed)
    opt = make_optimizer(student, spec)
    if spec.grad_checkpoint:
        _checkpointing(student, spec.grad_checkpoint)
    timer = PhaseTimer(device, spec.grad_accum)
    kd_module = next(m for m in forward_module.modules() if isinstance(m, KDStudent))
    kd_module.timer = timer
    kd_module.loss_impl = "compiled" if compile_on(spec, device) else "fused"
    student.train()
    evaluate(0)
    loss_curve: list[float] = []
    timings: list[dict[str, float]] = []
    it = iter(batches)
    tokens = 0
    steplog = StepLog("distill", spec.steps)
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        step_loss = torch.zeros((), device=device)
        for micro in range(spec.grad_accum):
            ids = _next_batch(it, step * spec.grad_accum + micro, spec)
            tokens += ids.numel()
            ids = ranks.shard(ids).to(device)
            timer.start()
            with torch.no_grad(), _autocast(amp, device), _routing(teacher, adapter, routing):
                t_last, t_hidden = base_forward(teacher, ids, kd.uses_hidden)
            timer.mark("teacher")
            with ranks.no_sync(forward_module, micro == spec.grad_accum - 1), _autocast(amp, device):
                loss = forward_module(ids, t_last, t_head.weight, t_hidden, t_head.bias) / spec.grad_accum
            loss.backward()
            timer.mark("backward")
            step_loss += loss.detach().float()
        if spec.grad_clip:
            torch.nn.utils.clip_grad_norm_(student.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        step_loss = ranks.sum(step_loss)
        timer.mark("comm")
        loss_curve.append(float(step_loss / ranks.world))
        done = step + 1
        if ranks.rank == 0:
            steplog(done, loss_curve[-1], tokens)
        if done % spec.eval_every == 0 or done == spec.steps:
            timings.append({"step": done, **timer.summary()})
            if ranks.rank == 0:
                _log_times(timings[-1], spec.steps)
            evaluate(done)
        if progress is not None:
            progress(done, spec.steps)
    kd_module.timer, kd_module.loss_impl = None, "fused"
    student.eval()
    if spec.grad_checkpoint:
        _checkpointing(student, False)
    return {
        "val": records,
        "loss_curve": loss_curve,
        "tokens": tokens,
        "teacher_routing": routing,
        "settings": asdict(spec),
        "timings": timings,
    }


def _log_times(times: dict[str, float], steps: int) -> None:
    """One step-log line with the micro-step's phases (ms, medians since the last line): the job's log."""
    parts = [f"distill: step {times['step']}/{steps}"]
    parts += [f"{k} {v:.1f}" for k, v in times.items() if k != "step"]
    print("  ".join(parts), file=sys.stdout, flush=True)


def distill(
    student: nn.Module,
    teacher: nn.Module,
    adapter: Any,
    batches: Iterable[torch.Tensor],
    val: torch.Tensor,
    spec: DistillSpec,
    progress: Callable[[int, int], None] | None = None,
    on_val: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Distill `student` (trained in place) from `teacher`; `adapter` is the teacher's FamilyAdapter
    (None for a dense teacher, e.g. the D2D baseline). `batches` yields LongTensor [batch_size, seq_len]
    micro-batches (grad_accum per step); `val` is LongTensor [n, seq_len].

    Returns {"val": [{"value", "who", "step", "tokens"}], "loss_curve": [per-step loss], "tokens": int,
    "teacher_routing": {"top_k", "renormalize", "native_top_k"} | None, "settings": dict}. Validation CE
    (nats/token) of the student is measured at step 0, every eval_every steps and at the end; the
    teacher's once, and recorded at the same steps. `on_val(record)` sees each record as it is made.
    The student keeps fp32 master weights during training and gets its original dtype back at the end.
    """
    dtype = next(student.parameters()).dtype
    if dtype != torch.float32:
        student.float()
    kd_module = KDStudent(student, LOSSES[spec.loss], spec.tau, spec.hidden_weight, spec.logit_chunk)
    try:
        return train_loop(student, kd_module, teacher, adapter, batches, val, spec, progress, on_val)
    finally:
        if dtype != torch.float32:
            student.to(dtype)
