"""Fleet's ``DistributedStrategy`` with every ``*_configs`` readable and settable under today's protobuf.

Why a strategy class of our own: Paddle 2.6 reads and writes its ``*_configs`` with helpers that ask a
protobuf field for its ``label``, which today's protobuf no longer has (Paddle 3 asks ``is_repeated``), so
its getters fail and its setters with them ("sharding_configs is not a attribute of DistributedStrategy").
This class runs Paddle's own getter and setter of every ``*_configs`` property that uses those helpers,
with Paddle 3.3's label-free helpers where Paddle's fail: names, defaults and merging stay Paddle's, and an
unknown key is refused (an ``AssertionError``, as Paddle's, and a ``ValueError``) naming the keys there are.
Paddle 2.6's ``build_strategy`` setter asks for ``label`` itself: there it is Paddle 3.3's setter. (Names
Paddle's own strategy lacks stay refused as Paddle refuses them: ``calc_comm_same_stream`` is Paddle's
``_calc_comm_same_stream``; Paddle 2.6 raises TypeError for the public name, Paddle 3.3 keeps it as a plain
attribute that changes nothing.)

Why a module of its own: the protobuf plumbing is independent of what fleet's functions do with a strategy.
"""
from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Callable

from .._paddle import paddle

_PADDLE = paddle.distributed.fleet.DistributedStrategy
_MODULE = sys.modules[_PADDLE.__module__]  # Paddle's distributed_strategy module: its helpers and protobuf


class ConfigKeyError(ValueError, AssertionError):
    """An unknown key in a ``*_configs`` dict: an AssertionError as Paddle's, a ValueError as staticpipe's."""


# --- Paddle's protobuf helpers without FieldDescriptor.label (Paddle 3.3's: label is gone from protobuf 7) ---
def _is_repeated(field: Any) -> bool:
    repeated = getattr(field, "is_repeated", None)
    if repeated is None:
        return field.label == field.LABEL_REPEATED
    return repeated if isinstance(repeated, bool) else repeated()


def _msg_dict(msg: Any) -> dict:
    return {f.name: ((_repeated_msg_dicts(v) if f.type == f.TYPE_MESSAGE else list(v)) if _is_repeated(f) else v)
            for f in msg.DESCRIPTOR.fields for v in (getattr(msg, f.name),)}


def _repeated_msg_dicts(msgs: Any) -> list[dict]:
    return [{f.name: list(v) if _is_repeated(f) else v for f in item.DESCRIPTOR.fields
             for v in (getattr(item, f.name),)} for item in msgs]


def _assign(msg: Any, config: Any, _items: bool = False) -> None:
    """Paddle's ``assign_configs_value`` and (``_items``) ``assign_repeated_msg``, as Paddle 3.3 has them."""
    for key in config:
        item = msg.add() if _items else msg
        for f in item.DESCRIPTOR.fields:
            if key == f.name and not _is_repeated(f):
                setattr(item, f.name, config[f.name])
            elif key == f.name and config[f.name] is not None and f.type == f.TYPE_MESSAGE:
                _assign(getattr(msg, f.name), config[f.name], not _items)
            elif key == f.name and config[f.name] is not None:
                getattr(msg, f.name).extend(config[f.name])


def _check_keys(name: str, msg: Any, config: dict, field_name: str) -> None:
    """Paddle's ``check_configs_key``, naming the property and its keys (Paddle names some otherwise)."""
    keys = msg.DESCRIPTOR.fields_by_name
    for key in config:
        if key not in keys:
            raise ConfigKeyError(f"strategy.{name}: unknown key {key!r}; its keys are {sorted(keys)}")


_HELPERS = {"get_msg_dict": _msg_dict, "get_repeated_msg_dict": _repeated_msg_dicts, "assign_configs_value": _assign,
            "assign_repeated_msg": functools.partial(_assign, _items=True)}


def _paddles_helpers_work() -> bool:
    try:
        _MODULE.get_msg_dict(_MODULE.distributed_strategy_pb2.DistributedStrategy())
    except AttributeError:  # Paddle 2.6 under protobuf 7: FieldDescriptor has no label
        return False
    return True


def _rebound(function: Callable | None, names: dict) -> Callable | None:
    """Paddle's ``function`` (a property's getter or setter) calling ``names`` for its module's globals."""
    if function is None:
        return None
    inner = inspect.unwrap(function)  # Paddle's setters are wrapped by is_strict_auto
    copy = types.FunctionType(inner.__code__, {**inner.__globals__, **names}, inner.__name__, inner.__defaults__,
                              inner.__closure__)
    copy.__doc__, copy.__qualname__ = inner.__doc__, inner.__qualname__
    return _MODULE.is_strict_auto(copy) if inner is not function else copy


def _configs_properties() -> dict[str, property]:
    """Every ``*_configs`` property of Paddle's strategy that reads or writes through the helpers above, as
    Paddle's getter and setter with this module's key check, and its helpers where Paddle's fail."""
    helpers = {} if _paddles_helpers_work() else _HELPERS
    found = {}
    for name, prop in inspect.getmembers(_PADDLE, lambda p: isinstance(p, property)):
        used = {n for f in (prop.fget, prop.fset) if f is not None for n in inspect.unwrap(f).__code__.co_names}
        if name.endswith("_configs") and used & {*_HELPERS, "check_configs_key"}:
            names = {**helpers, "check_configs_key": functools.partial(_check_keys, name)}
            found[name] = property(_rebound(prop.fget, names), _rebound(prop.fset, names), doc=prop.__doc__)
    return found


class DistributedStrategy(_PADDLE):
    """Paddle's ``fleet.DistributedStrategy``, its ``*_configs`` readable and settable with any protobuf."""


def _set_build_strategy(self: Any, strategy: Any) -> None:
    """Paddle's ``build_strategy`` setter as Paddle 3.3 has it: Paddle 2.6's asks each field for its ``label``."""
    for f in self.strategy.build_strategy.DESCRIPTOR.fields:
        if not _is_repeated(f):  # optional and required fields
            value = getattr(strategy, f.name)
            setattr(self.strategy.build_strategy, f.name,
                    _MODULE.ReduceStrategyFleet(value) if f.name == "reduce_strategy" else value)
        else:
            getattr(self.strategy.build_strategy, f.name).extend(getattr(strategy, f.name))


CONFIGS = _configs_properties()
for _name, _property in CONFIGS.items():
    setattr(DistributedStrategy, _name, _property)
if not _paddles_helpers_work():  # the other properties that ask for label (sparse_table_configs: parameter server)
    DistributedStrategy.build_strategy = property(_PADDLE.build_strategy.fget, _MODULE.is_strict_auto(
        _set_build_strategy), doc=_PADDLE.build_strategy.__doc__)


def config_of(strategy: Any, name: str) -> dict:
    """``strategy``'s ``name`` configs as Paddle's getter gives them (this module's strategy or Paddle's own)."""
    return CONFIGS[name].fget(strategy)


__all__ = ["DistributedStrategy", "ConfigKeyError", "CONFIGS", "config_of"]
