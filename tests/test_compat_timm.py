"""d9dfn.compat.timm: timm-style TrainingTask modules trained by d9dfn's pure step.

Two task modules written as timm writes them — classification, and logit distillation from a frozen
teacher (KL with temperature) — are trained through :class:`TimmTask` and compared with the same
computation written directly as d9dfn tasks.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from torch import nn

import d9dfn
from d9dfn import optim
from d9dfn.compat.timm import TimmTask, TrainingTask, check_task_module
from d9dfn.testing import assert_trees_close, microbatch_counts

IN, HIDDEN, CLASSES = 8, 16, 4
TEMPERATURE, ALPHA = 2.0, 0.7


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))


def make_batch(batch_size: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs whose class is the argmax of a fixed linear map: learnable by the MLP."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, IN, generator=gen)
    w = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(123))
    return x, (x @ w).argmax(-1)


# --- the user's timm-style task modules ------------------------------------------------------------------


class ClassificationTask(TrainingTask):
    def __init__(self, model: nn.Module, criterion: nn.Module | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.criterion = criterion or nn.CrossEntropyLoss()

    def forward(self, input, target):
        output = self.model(input)
        return {"loss": self.criterion(output, target), "output": output}


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) at temperature T, scaled by T² (Hinton et al.)."""
    log_student = F.log_softmax(student_logits / TEMPERATURE, dim=-1)
    log_teacher = F.log_softmax(teacher_logits / TEMPERATURE, dim=-1)
    return F.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True) * TEMPERATURE**2


class LogitDistillationTask(TrainingTask):
    """Student + frozen teacher; the teacher sees normalized inputs (non-persistent buffers)."""

    def __init__(self, student: nn.Module, teacher: nn.Module, **kwargs) -> None:
        super().__init__(**kwargs)
        self.student = student
        self.teacher = teacher
        self.teacher.requires_grad_(False)
        self.teacher.eval()
        self.register_buffer("teacher_mean", torch.full((IN,), 0.1), persistent=False)
        self.register_buffer("teacher_std", torch.full((IN,), 1.5), persistent=False)
        self.criterion = nn.CrossEntropyLoss()

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # the teacher stays in eval mode
        return self

    def forward(self, input, target):
        output = self.student(input)
        with torch.no_grad():
            teacher_logits = self.teacher((input - self.teacher_mean) / self.teacher_std)
        task = self.criterion(output, target)
        kd = kd_loss(output, teacher_logits)
        return {"loss": ALPHA * kd + (1 - ALPHA) * task, "output": output, "task_loss": task, "kd_loss": kd}


# --- the same computations written directly as d9dfn tasks -------------------------------------------------


class DirectClassifier(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return {"logits": self.model(x)}


class DirectStudentTeacher(nn.Module):
    def __init__(self, student: nn.Module, teacher: nn.Module) -> None:
        super().__init__()
        self.student = student
        self.teacher = teacher.requires_grad_(False).eval()
        self.register_buffer("teacher_mean", torch.full((IN,), 0.1), persistent=False)
        self.register_buffer("teacher_std", torch.full((IN,), 1.5), persistent=False)

    def forward(self, x):
        teacher = self.teacher((x - self.teacher_mean) / self.teacher_std)
        return {"logits": self.student(x), "teacher_logits": teacher.detach()}


class DirectTask(d9dfn.TrainTask):
    def __init__(self, distill: bool) -> None:
        self.distill = distill

    def build_forward_inputs(self, batch, state):
        x, y = batch
        return d9dfn.BuildForwardInputsResult(inputs={"x": x}), state.set("y", y)

    def compute_loss(self, outputs, state, step):
        task = F.cross_entropy(outputs["logits"], state["y"])
        loss = task
        if self.distill:
            loss = ALPHA * kd_loss(outputs["logits"], outputs["teacher_logits"]) + (1 - ALPHA) * task
        weight = torch.tensor(float(state["y"].shape[0]))
        return d9dfn.ComputeLossResult(loss=loss, loss_weight=weight)


def train(model, task, steps: int, num_microbatches: int = 2, compile: bool = False):
    opt = optim.adamw(1e-2)
    state = d9dfn.init_train_state(model, opt, task=task)
    step = d9dfn.make_train_step(
        model, task, opt, num_microbatches=num_microbatches, compile="aot_eager" if compile else False
    )
    losses = []
    for i in range(steps):
        state, out = step(state, make_batch(seed=i % 4))
        losses.append(float(out.loss))
    return state, losses, out


def _distillation_pair():
    torch.manual_seed(0)
    student, teacher = mlp(), mlp()
    adapted = LogitDistillationTask(student, teacher)
    torch.manual_seed(0)
    direct = DirectStudentTeacher(mlp(), mlp())
    return adapted, direct


def test_timm_task_classification_trains_like_the_direct_task():
    torch.manual_seed(0)
    task = TimmTask(top_k=(1, 2))
    adapted, losses, out = train(ClassificationTask(mlp()), task, steps=15)
    torch.manual_seed(0)
    direct, direct_losses, _ = train(DirectClassifier(mlp()), DirectTask(distill=False), steps=15)
    assert losses[-1] < 0.7 * losses[0]
    # The same float32 ops in the same order: the params agree bit for bit (tolerance 0).
    assert_trees_close(adapted.params, direct.params, rtol=0, atol=0)
    assert losses == direct_losses
    assert out.logs == {}  # the module returned only loss and output
    accuracy = task.create_metrics().compute(adapted.metric_state)
    assert int(adapted.metric_state["top1"].total) == 15 * 12
    assert 0.0 < float(accuracy["top1"]) <= float(accuracy["top2"]) <= 1.0


def test_timm_task_distillation_trains_like_the_direct_task():
    adapted_module, direct_module = _distillation_pair()
    adapted, losses, out = train(adapted_module, TimmTask(), steps=15)
    direct, direct_losses, _ = train(direct_module, DirectTask(distill=True), steps=15)
    assert losses[-1] < 0.8 * losses[0]
    assert_trees_close(adapted.params, direct.params, rtol=0, atol=0)
    assert losses == direct_losses
    assert sorted(out.logs) == ["kd_loss", "task_loss"]
    expected = ALPHA * out.logs["kd_loss"] + (1 - ALPHA) * out.logs["task_loss"]
    assert float(out.loss) == pytest.approx(float(expected), rel=1e-5)  # both are weighted batch means


def test_timm_task_teacher_is_a_constant():
    module, _ = _distillation_pair()
    opt = optim.adamw(1e-2)
    start = d9dfn.init_train_state(module, opt)
    teacher = {name: t.clone() for name, t in start.params.items() if name.startswith("teacher")}
    assert sorted(teacher) == ["teacher.0.bias", "teacher.0.weight", "teacher.2.bias", "teacher.2.weight"]
    assert sorted(start.frozen) == sorted(teacher)  # frozen params of the state, not buffers
    assert sorted(start.buffers) == ["teacher_mean", "teacher_std"]
    paths = [d9dfn.format_path(path) for path in d9dfn.tree_flatten_with_path(start.opt_state)[0]]
    assert any("student" in path for path in paths)
    assert not any("teacher" in path for path in paths)  # no optimizer state for the teacher
    step = d9dfn.make_train_step(module, TimmTask(), opt, num_microbatches=2, compile=False)
    state = start
    for i in range(3):
        state, _ = step(state, make_batch(seed=i))
    assert_trees_close({name: state.params[name] for name in teacher}, teacher, rtol=0, atol=0)
    assert not torch.equal(state.params["student.0.weight"], start.params["student.0.weight"])


@given(microbatch_counts(min_value=1, max_value=4))
def test_timm_task_microbatching_gives_the_batch_mean(num_microbatches):
    results = []
    for count in (1, num_microbatches):
        module, _ = _distillation_pair()
        opt = optim.sgd(0.5)
        step = d9dfn.make_train_step(module, TimmTask(), opt, num_microbatches=count, compile=False)
        results.append(step(d9dfn.init_train_state(module, opt), make_batch(batch_size=12)))
    (whole, whole_out), (split, split_out) = results
    assert float(split_out.loss) == pytest.approx(float(whole_out.loss), rel=1e-5)
    assert float(split_out.loss_weight) == 12.0
    assert_trees_close(split.params, whole.params, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_timm_task_compiles_without_recompiling():
    module, _ = _distillation_pair()
    task = TimmTask(top_k=(1,))
    torch._dynamo.reset()
    eager, eager_losses, _ = train(module, task, steps=3)
    opt = optim.adamw(1e-2)
    state = d9dfn.init_train_state(module, opt, task=task)
    step = d9dfn.make_train_step(module, task, opt, num_microbatches=2, compile="aot_eager")
    losses = []
    for i in range(3):
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            state, out = step(state, make_batch(seed=i))
        losses.append(float(out.loss))
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert_trees_close(state.params, eager.params, rtol=1e-5, atol=1e-6)
    assert int(state.metric_state["top1"].total) == 36


def test_timm_task_accepts_dict_batches():
    x, y = make_batch()
    results = []
    for batch in ((x, y), {"input": x, "target": y}, [x, y]):
        torch.manual_seed(0)
        module, opt = ClassificationTask(mlp()), optim.sgd(0.1)
        step = d9dfn.make_train_step(module, TimmTask(), opt, compile=False)
        results.append(step(d9dfn.init_train_state(module, opt), batch)[0].params)
    assert_trees_close(results[1], results[0], rtol=0, atol=0)
    assert_trees_close(results[2], results[0], rtol=0, atol=0)


def test_timm_task_custom_argument_names():
    class Task(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = mlp()

        def forward(self, images, labels):
            output = self.model(images)
            return {"loss": F.cross_entropy(output, labels), "output": output}

    module = check_task_module(Task(), input_name="images", target_name="labels")
    task, opt = TimmTask(input_name="images", target_name="labels"), optim.sgd(0.1)
    x, y = make_batch()
    _, out = d9dfn.make_train_step(module, task, opt, compile=False)(
        d9dfn.init_train_state(module, opt), {"images": x, "labels": y}
    )
    assert torch.isfinite(out.loss)


# --- prepare_distributed, .to and checks --------------------------------------------------------------


def test_training_task_prepare_distributed_and_to_keep_working():
    module = ClassificationTask(mlp(), device=torch.device("cpu"))
    assert module.prepare_distributed(device_ids=[0], find_unused_parameters=True) is module
    assert isinstance(module.model, nn.Sequential)  # nothing was wrapped
    assert module.to("cpu") is module
    assert module.device == torch.device("cpu")
    module = module.to(torch.float64)
    assert module.dtype == torch.float64
    assert module.model[0].weight.dtype == torch.float64
    check_task_module(module)


def test_check_task_module_rejects_distributed_wrappers_and_other_signatures():
    module = ClassificationTask(mlp())
    module.model = nn.DataParallel(module.model)  # what timm's prepare_distributed does, with DDP
    with pytest.raises(TypeError, match=r"submodule 'model' is a DataParallel.*do not call timm's prepare_distributed"):
        check_task_module(module)

    class TwoArgs(nn.Module):
        def forward(self, x, y):
            return {"loss": x.sum()}

    with pytest.raises(TypeError, match=r"cannot take \['input', 'target'\] by keyword"):
        check_task_module(TwoArgs())
    with pytest.raises(TypeError, match=r"expected an nn\.Module task"):
        check_task_module(lambda input, target: None)

    class Kwargs(nn.Module):
        def forward(self, **batch):
            return {"loss": batch["input"].sum()}

    check_task_module(Kwargs())


def _step_once(module, task, batch=None):
    opt = optim.sgd(0.1)
    step = d9dfn.make_train_step(module, task, opt, compile=False)
    return step(d9dfn.init_train_state(module, opt, task=task), make_batch() if batch is None else batch)


def test_timm_task_errors_name_the_fix():
    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = mlp()

        def forward(self, input, target):
            return {"output": self.model(input)}

    with pytest.raises(ValueError, match=r"returned keys \['output'\] without 'loss'"):
        _step_once(NoLoss(), TimmTask())

    class VectorLoss(ClassificationTask):
        def forward(self, input, target):
            output = self.model(input)
            return {"loss": F.cross_entropy(output, target, reduction="none")}

    with pytest.raises(ValueError, match=r"outputs\['loss'\] is \(12,\); return the batch's mean loss"):
        _step_once(VectorLoss(mlp()), TimmTask())

    class NoOutput(ClassificationTask):
        def forward(self, input, target):
            return {"loss": self.criterion(self.model(input), target)}

    with pytest.raises(ValueError, match=r"needs the module's 'output'"):
        _step_once(NoOutput(mlp()), TimmTask(top_k=(1,)))
    with pytest.raises(TypeError, match=r"got a batch of type dict with keys \['x'\]"):
        _step_once(ClassificationTask(mlp()), TimmTask(), {"x": make_batch()[0]})


# --- in d9dfn's loop ------------------------------------------------------------------------------------


def test_timm_task_runs_in_the_loop(tmp_path):
    from d9dfn.config import DeviceMeshParameters as Mesh
    from d9dfn.config import TrainerConfig
    from d9dfn.loop import InitializeDatasetResult, InitializeModelStageResult, ModelProvider, TrainingConfigurator

    class Provider(ModelProvider):
        def initialize_model_stage(self, context):
            return InitializeModelStageResult(model=check_task_module(ClassificationTask(mlp()).prepare_distributed()))

    x, y = make_batch(batch_size=48)
    data = list(zip(x, y, strict=True))
    config = TrainerConfig.model_validate(
        {
            "optimizer": {"name": "adamw", "lr": 1e-2},
            "batching": {"global_batch_size": 12, "microbatch_size": 6},
            "checkpointing": {"save_dir": str(tmp_path), "period_steps": 8},
            "logging": {"period_steps": 4},
            "total_steps": 8,
            "compile": False,
        }
    )
    result = (
        TrainingConfigurator(
            mesh=Mesh(),
            parameters=config,
            task_provider=lambda: TimmTask(top_k=(1,)),
            model_provider=Provider(),
            data_provider=lambda context: InitializeDatasetResult(
                dataset=data, collator=lambda items: tuple(torch.stack(column) for column in zip(*items, strict=True))
            ),
        )
        .configure()
        .train()
    )
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8
    assert losses[-1] < losses[0]
    assert any("metrics/top1" in r for r in records)


# --- the migration page's d9dfn code runs -------------------------------------------------------------------


@pytest.mark.slow
def test_migration_page_code_runs(monkeypatch, capsys):
    import re
    from pathlib import Path

    import d9dfn.step._options

    page = Path(__file__).resolve().parent.parent / "docs" / "migration" / "from-timm.md"
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL) if "d9dfn" in b]
    assert len(blocks) == 1
    # The page compiles with the default backend; aot_eager checks the same whole-graph trace, faster.
    real_backend_of = d9dfn.step._options.backend_of
    monkeypatch.setattr(
        d9dfn.step._options, "backend_of", lambda compile: "aot_eager" if compile is True else real_backend_of(compile)
    )
    namespace: dict = {}
    exec(compile(blocks[0], str(page), "exec"), namespace)
    lines = capsys.readouterr().out.split("\n")
    losses = [float(line.split()[0]) for line in lines[:3]]
    assert losses[-1] < losses[0]
    assert 0.0 < float(lines[3]) <= 1.0
    state = namespace["state"]
    assert {name for name in state.params if name.startswith("teacher")} == set(state.frozen)  # frozen params
