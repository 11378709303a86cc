"""The pipeline-aware FLOPs profiler (see docs/profiling.md)."""


def __getattr__(name):
    # Imported lazily: `import patches.profiler.module_profiler` must not pull in DeepSpeed's engine.
    if name == "PipelineFlopsProfiler":
        from patches.profiler.pipeline_profiler import PipelineFlopsProfiler
        return PipelineFlopsProfiler
    raise AttributeError(name)


__all__ = ["PipelineFlopsProfiler"]
