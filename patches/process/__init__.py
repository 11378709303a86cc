"""The process's plumbing: the patch set's own state, patches applied at a module's import, a clean exit, the
one-line errors, and values exchanged through the process group's store."""
