"""Shadowing an attribute on one instance, undoably: how the profiler wraps a method or a table of one engine,
module or optimizer without touching its class or any other instance."""
from typing import Any, Callable


def shadow(owner: object, name: str, replacement: Any) -> Callable[[], None]:
    """Set `name` on `owner` itself to `replacement`; returns what undoes it: the instance's own previous value put
    back, or, where it had none, the instance attribute deleted so that the class's shows again."""
    had_own = name in vars(owner)
    previous = vars(owner).get(name)
    setattr(owner, name, replacement)

    def undo() -> None:
        if had_own:
            setattr(owner, name, previous)
        else:
            delattr(owner, name)
    return undo
