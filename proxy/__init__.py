"""tether: a sidecar that aborts abandoned LLM requests upstream and keeps request IDs unique."""

from . import compiled

__version__ = "0.1.0"

# Before any module of the data plane is imported: TETHER_NO_EXTENSIONS=1 runs their
# pure-Python source even where the compiled ones are installed, and so does an install with
# only some of them (`proxy.compiled`).
if compiled.pure_forced() or not compiled.build_complete():
    compiled.use_pure_modules()
