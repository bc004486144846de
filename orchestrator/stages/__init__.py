"""The built-in stages, in the order a sweep runs them (each module declares one `Stage`)."""

from orchestrator.stage import register
from orchestrator.stages import (
    calibrate,
    convert,
    dcdm,
    distill,
    dot_moe,
    evaluate,
    expert_maxima,
    ppl_pre,
    router_kd,
    seeds,
    teacher,
)

for _stage in (
    teacher.STAGE,
    teacher.DENSE,
    calibrate.STAGE,
    expert_maxima.STAGE,
    dcdm.STAGE,
    convert.STAGE,
    ppl_pre.STAGE,
    seeds.CONVERT,
    seeds.PPL,
    distill.STAGE,
    router_kd.STAGE,
    evaluate.STAGE,
    dot_moe.STAGE,
):
    register(_stage)
