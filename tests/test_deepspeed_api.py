"""DeepSpeed's profiler API details that need no process group: ignore_list, the section's refused key,
and the per-patch version check."""
import pytest
import torch
from deepspeed.profiling.config import DeepSpeedFlopsProfilerConfig

import patches
from patches import to_deepspeed
from patches.process.errors import PatchConfigError
from patches.profiler.module_profiler import ModuleProfiler
from patches.to_deepspeed import flops_profiler_config, pipeline_timers, section_timers


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                               torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)))


def _tree(ignore_types):
    model = _model()
    profiler = ModuleProfiler(model, ignore_types=ignore_types)
    profiler.start()
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    profiler.stop()
    profiler.remove()
    return profiler.tree()


def test_ignore_list_leaves_module_types_out_of_the_profile():
    full = _tree(())
    assert (full["params"], full["fwd_flops"]) == (4 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2, 2 * 3 * (4 * 8 + 8 * 8 + 8 * 2))
    no_inner = _tree((torch.nn.Sequential,))  # the root is kept; the inner Sequential and its layers go
    assert [child["name"] for child in no_inner["children"]] == ["0", "1"]
    assert (no_inner["params"], no_inner["fwd_flops"]) == (4 * 8 + 8, 2 * 3 * 4 * 8)
    assert no_inner["bwd_flops"] == full["children"][0]["bwd_flops"]
    no_linear = _tree((torch.nn.Linear,))
    assert (no_linear["params"], no_linear["fwd_flops"], no_linear["bwd_flops"]) == (0, 0, 0)


def test_recompute_fwd_factor_is_refused_in_one_line():
    flops_profiler_config.check_section(DeepSpeedFlopsProfilerConfig({"flops_profiler": {"enabled": True}}))
    section = DeepSpeedFlopsProfilerConfig({"flops_profiler": {"enabled": True, "recompute_fwd_factor": 1.0}})
    with pytest.raises(PatchConfigError, match="recompute_fwd_factor 1 is not used") as error:
        flops_profiler_config.check_section(section)
    assert "\n" not in str(error.value)


def test_every_patch_names_the_deepspeed_attributes_it_needs_and_this_deepspeed_has_them():
    for patch in (section_timers, flops_profiler_config, pipeline_timers):
        assert patch.requires() and patch.WHAT_IT_FIXES
        assert to_deepspeed.missing_attributes(patch.requires()) == []


def test_a_missing_deepspeed_attribute_is_named():
    class Engine:
        present = None

    assert to_deepspeed.missing_attributes([(Engine, "present"), (Engine, "_renamed_in_a_release")]) == [
        "Engine._renamed_in_a_release"]
    assert patches.untested_version_warning("0.13.0").startswith(
        "warning: patches: DeepSpeed 0.13.0 is not among the tested versions (0.19.8, 0.19.6")


def test_the_profiler_names_the_private_deepspeed_internals_an_engine_lacks():
    """A release that renames what the hooks use is refused by name, never profiled into an empty report."""
    from types import SimpleNamespace

    from patches.profiler.engine_hooks import missing_internals
    from patches.profiler.layout import EngineLayout

    pipeline = EngineLayout(0, 0, 0, 2, 1, 1, is_pipeline=True)
    renamed = SimpleNamespace(module=SimpleNamespace())
    assert missing_internals(renamed, pipeline) == [
        "PipelineEngine._INSTRUCTION_MAP", "PipelineModule.forward_funcs", "PipelineModule.tied_modules"]
    plain = EngineLayout(0, 0, 0, 1, 1, 1, is_pipeline=False)
    assert missing_internals(renamed, plain) == []  # its methods are wrapped once, at apply (engine_methods)
    from patches.to_deepspeed import engine_methods

    assert [f"{owner.__name__}.{name}" for owner, name in engine_methods.requires()] == [
        "DeepSpeedEngine.__init__", "PipelineEngine.__init__", "PipelineEngine.train_batch",
        "DeepSpeedEngine.forward", "DeepSpeedEngine.backward", "DeepSpeedEngine.step"]


def test_every_public_method_of_deepspeeds_flops_profiler_is_there_with_its_parameters():
    """Code written against DeepSpeed's FlopsProfiler runs unchanged on ours (both classes)."""
    import inspect

    from deepspeed.profiling.flops_profiler import FlopsProfiler

    from patches.profiler import PipelineFlopsProfiler
    from patches.profiler.user_code_profiler import UserCodeFlopsProfiler

    public = [name for name, _ in inspect.getmembers(FlopsProfiler, inspect.isfunction) if not name.startswith("_")]
    assert "print_model_aggregated_profile" in public and "is_expert_tensor_parallelism_enabled" in public
    for ours in (PipelineFlopsProfiler, UserCodeFlopsProfiler):
        for name in public:
            theirs = list(inspect.signature(getattr(FlopsProfiler, name)).parameters)
            assert list(inspect.signature(getattr(ours, name)).parameters)[:len(theirs)] == theirs, (ours, name)
    assert issubclass(UserCodeFlopsProfiler, FlopsProfiler)


def test_flops_profiler_of_a_plain_module_is_deepspeeds_own_after_apply():
    """Only a PipelineEngine (or its PipelineModule) gets the pipeline-aware profiler; get_model_profile is stock."""
    from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile

    patches.apply()
    model = _model()
    prof = FlopsProfiler(model)
    assert type(prof) is FlopsProfiler
    prof.start_profile()
    model(torch.randn(3, 4))
    assert prof.get_total_params() == 4 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2
    prof.end_profile()
    flops, macs, params = get_model_profile(_model(), input_shape=(3, 4), print_profile=False, as_string=False)
    assert (macs, params) == (3 * (4 * 8 + 8 * 8 + 8 * 2), 4 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2)
