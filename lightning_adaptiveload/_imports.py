"""Objects named by dotted import paths in configs (pattern lists, block classes), with errors
that say which part of the path failed."""
from __future__ import annotations

import importlib


def import_object(path: str, what: str) -> object:
    """The object at 'package.module.NAME' (or 'package.module.Class.NAME'): the longest prefix
    that is a module, then attributes. `what` names the setting in errors ("block class ...")."""
    parts = path.split(".")
    missing = []
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            # only a missing prefix of this path means "try a shorter module"; a module that
            # imports something missing is a broken module, said as such
            if error.name is None or not module_name.startswith(error.name):
                raise ValueError(f"{what} {path!r} cannot be imported: importing {module_name!r} failed: {error}") from error
            missing.append(f"{module_name}: {error}")
            continue
        except ImportError as error:
            raise ValueError(f"{what} {path!r} cannot be imported: importing {module_name!r} failed: {error}") from error
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(f"{what} {path!r} cannot be imported: module {module_name!r} has no "
                             f"{'.'.join(parts[split:])!r}") from None
        return obj
    raise ValueError(f"{what} {path!r} cannot be imported: no 'module.NAME' in it "
                     f"({'; '.join(missing) or 'no module part'})")
