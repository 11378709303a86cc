"""A pipeline checkpoint resumed under another partition of the layers (partition/method.py cuts them anew).

DeepSpeed saves a PipelineModule's weights one file per layer (layer_05-model_00-model_states.pt), so they
load under any partition. The optimizer state is saved per stage (in mp_rank_XX_model_states.pt, or ZeRO's
files) as the stage's flat list of parameters: loaded into a stage that holds other layers, torch refuses it
(groups of another size) or, where the sizes happen to agree, gives each parameter another one's state.

Every pipeline checkpoint saved after patches.apply() records its parts (PARTS_KEY in the client state, a list
of ints that a loader not knowing it leaves alone). Loading one under other parts:
- with the optimizer state asked for: PatchConfigError, one line saying so and how to resume without it;
- without it (load_optimizer_states=False or load_module_only=True, or Megatron's --no-load-optim, which the
  run's settings make count here, process/registry.py): all else loads as asked, the fp32 master weights of a
  fp16/bf16/ZeRO optimizer are taken from the loaded weights (DeepSpeed refreshes them only for
  load_module_only), and one line on global rank 0 says the optimizer state starts afresh.
A checkpoint without the record (saved without the patches), or of the same parts, loads as DeepSpeed loads it.
"""
import os
from typing import List, Optional

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineModule

from patches.process.errors import PatchConfigError
from patches.process.registry import REGISTRY

WHAT_IT_FIXES = "a pipeline checkpoint resumed under another partition"
PARTS_KEY = "pipeline_parts"



def requires():
    return [(DeepSpeedEngine, "save_checkpoint"), (DeepSpeedEngine, "load_checkpoint"),
            (DeepSpeedEngine, "_get_all_ckpt_names"), (DeepSpeedEngine, "load_universal_checkpoint")]


def install():
    original_save, original_load = DeepSpeedEngine.save_checkpoint, DeepSpeedEngine.load_checkpoint

    def save_checkpoint(self, save_dir, tag=None, client_state=None, *args, **kwargs):
        """Records the partition, so that a resume under another one can tell."""
        client_state = {} if client_state is None else client_state  # DeepSpeed's own default
        parts = _parts(self)
        if parts is not None:
            client_state = {**client_state, PARTS_KEY: parts}
        return original_save(self, save_dir, tag, client_state, *args, **kwargs)

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        """DeepSpeed gap: per-stage optimizer state (ZeRO's partitions included) loaded into a stage holding other
        layers. Decided here, before DeepSpeed's load_checkpoint, which hands load_optimizer_states on to both
        the model-states load and ZeRO's."""
        options = dict(zip(_LOAD_OPTIONS, args), **kwargs)
        parts = _parts(self)
        if parts is None or self.load_universal_checkpoint():
            return original_load(self, load_dir, tag, **options)
        resolved = tag if tag is not None else _latest_tag(load_dir)
        saved = _saved_parts(self, load_dir, resolved)
        if saved is None or saved == parts:
            return original_load(self, load_dir, tag, **options)
        asked = options.get("load_optimizer_states", True) and not options.get("load_module_only", False)
        if asked and not REGISTRY.settings.drop_optimizer_state_across_partitions:
            raise PatchConfigError(
                f"checkpoint {resolved} in {load_dir} was saved with pipeline parts {saved}, this run cuts the "
                f"layers at {parts}: the weights are saved per layer and move, the optimizer state is saved per "
                "stage and cannot. Resume without it: --no-load-optim (Megatron), or "
                "engine.load_checkpoint(..., load_optimizer_states=False) (DeepSpeed)")
        load_path, client_state = original_load(self, load_dir, tag, **{**options, "load_optimizer_states": False})
        if isinstance(client_state, dict):
            client_state.pop("optimizer", None)  # the old stage's state, left in by DeepSpeed when not loaded
        if self.optimizer is not None and hasattr(self.optimizer, "refresh_fp32_params"):
            # fp16/bf16/ZeRO master weights from the loaded ones (DeepSpeed does it for load_module_only only)
            self.optimizer.refresh_fp32_params()
        if self.global_rank == 0:
            print(f"> checkpoint {resolved}: saved with pipeline parts {saved}, loaded with parts {parts}: its "
                  "weights move with their layers; its optimizer state, saved per stage, is not loaded and starts "
                  "afresh", flush=True)
        return load_path, client_state

    DeepSpeedEngine.save_checkpoint, DeepSpeedEngine.load_checkpoint = save_checkpoint, load_checkpoint


# DeepSpeedEngine.load_checkpoint's options after (load_dir, tag), in order
_LOAD_OPTIONS = ("load_module_strict", "load_optimizer_states", "load_lr_scheduler_states", "load_module_only",
                 "custom_load_fn")


def _parts(engine) -> Optional[List[int]]:
    module = getattr(engine, "module", None)
    if not isinstance(module, PipelineModule) or getattr(module, "parts", None) is None:
        return None
    return [int(part) for part in module.parts]


def _latest_tag(load_dir: str) -> Optional[str]:
    """The tag DeepSpeed loads when given none: its `latest` file's (None without one: DeepSpeed warns)."""
    try:
        with open(os.path.join(load_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return None


def _saved_parts(engine, load_dir: str, tag: Optional[str]) -> Optional[List[int]]:
    """The parts a checkpoint recorded (every model-states file records the same), or None: not recorded, or the
    file unreadable here (DeepSpeed's own load then says what is wrong). Memory-mapped: nothing large is read."""
    if tag is None:
        return None
    names = engine._get_all_ckpt_names(load_dir, tag)
    if not names:
        return None
    try:
        state = torch.load(names[0], map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # unpicklable here, not a zip file, ...: DeepSpeed's load reports it
        return None
    saved = state.get(PARTS_KEY) if isinstance(state, dict) else None
    return [int(part) for part in saved] if isinstance(saved, (list, tuple)) else None
