"""Fault injection: reproducible changes to a stopped process's memory and registers.

Every random choice comes from a :class:`random.Random` the caller seeds, so the
same seed gives the same faults; each change is returned as a :class:`Fault`
(what, where, which bits, the value before and after) to be logged.

The spec language of ``ptckpt restore --inject SPEC --seed N`` (repeatable; the
faults are made in the order given, in the image's root unless ``pid=`` names
another process by its image pid)::

    flip:symbol=NAME[+OFF],bits=N[,size=BYTES]   flip N distinct random bits (default 1)
    flip:addr=0xADDR,bits=N[,size=BYTES]         among the symbol's ELF size (or `size`
                                                 bytes; 8 at an address)
    set:symbol=NAME[+OFF],value=V[,size=BYTES]   write V (little-endian, size 1/2/4/8;
    set:addr=0xADDR,value=V[,size=BYTES]         default 8, or the symbol's size if smaller)
    reg:name=REG,value=V[,tid=T]                 set a register (rip, rax, ... as in
    reg:name=REG,bits=N[,tid=T]                  ProcessHandle.registers) or flip N bits
    call:function=F,n=N,arg=I,value=V            at the Nth call of F (a breakpoint, once the
    call:function=F,n=N,ret=V                    process runs): set argument I (0 = rdi ...),
    call:function=F,n=N,flip=SYMBOL,bits=B       make that call return V, or flip B bits of
                                                 SYMBOL; then the program runs on untraced

Plugin authors call :func:`flip_bits`, :func:`set_value`, :func:`flip_register`
and :func:`set_register` with a :class:`ptckpt.plugins.ProcessHandle`, or
:func:`inject` with a parsed :class:`FaultSpec`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .errors import UsageError

KINDS = ("flip", "set", "reg", "call")
_KEYS = {
    "flip": {"symbol", "addr", "bits", "size", "pid"},
    "set": {"symbol", "addr", "value", "size", "pid"},
    "reg": {"name", "value", "bits", "tid", "pid"},
    "call": {"function", "n", "arg", "value", "ret", "flip", "bits", "size", "pid"},
}


@dataclass(frozen=True)
class FaultSpec:
    """One parsed --inject SPEC."""

    text: str
    kind: str                   # flip | set | reg
    symbol: str = ""            # NAME[+OFF] or OBJECT:NAME[+OFF]
    addr: int | None = None
    size: int = 0               # 0: the default of the kind
    bits: int = 1
    value: int | None = None
    register: str = ""
    tid: int = 0
    pid: int = 0                # 0: the root
    function: str = ""          # call: the function whose Nth call makes the fault
    n: int = 1
    arg: int | None = None      # call: argument index (0: rdi ...) set to value
    ret: int | None = None      # call: the return value that call gets
    flip: str = ""              # call: flip bits of this symbol at the call

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Fault:
    """One change made: enough to tell what happened, and to make it again."""

    spec: str
    pid: int                    # the image pid
    target: str                 # "design_state+3" / "0x7f..." / "register rax of 1234"
    address: int                # 0 for a register
    bits: tuple[int, ...] = field(default=())   # bit numbers flipped (bit 0 = LSB of the first byte)
    before: str = ""            # hex
    after: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["bits"] = list(self.bits)
        return d

    def __str__(self) -> str:
        where = f" at {self.address:#x}" if self.address else ""
        what = f"bits {','.join(map(str, self.bits))}" if self.bits else "value"
        return f"{self.spec}: {self.target}{where} (process {self.pid}): {what}: {self.before} -> {self.after}"


def _int(spec: str, key: str, value: str) -> int:
    try:
        return int(value, 0)
    except ValueError:
        raise UsageError(f"--inject {spec!r}: {key}={value!r} is not a number") from None


def parse_spec(text: str) -> FaultSpec:
    """'flip:symbol=design_state,bits=1' -> FaultSpec; UsageError naming what is wrong."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in KINDS:
        raise UsageError(f"--inject {text!r}: expected KIND:KEY=VALUE,... with KIND one of {', '.join(KINDS)}")
    values: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in _KEYS[kind]:
            raise UsageError(f"--inject {text!r}: {item!r} is not one of "
                             f"{', '.join(sorted(k + '=' for k in _KEYS[kind]))}")
        values[key] = value
    args: dict = {"text": text, "kind": kind}
    for key in ("size", "bits", "tid", "pid"):
        if key in values:
            args[key] = _int(text, key, values[key])
    for key in ("value", "n", "arg", "ret"):
        if key in values:
            args[key] = _int(text, key, values[key])
    if kind == "call":
        actions = [("arg" in values and "value" in values), "ret" in values, "flip" in values]
        if "function" not in values or sum(actions) != 1 or ("arg" in values) != ("value" in values):
            raise UsageError(f"--inject {text!r}: call needs function=F and one of arg=I,value=V | ret=V | "
                             f"flip=SYMBOL")
        args["function"], args["flip"] = values["function"], values.get("flip", "")
        if args.get("n", 1) < 1 or not 0 <= args.get("arg", 0) < 6:
            raise UsageError(f"--inject {text!r}: n must be >= 1 and arg 0..5")
    elif kind == "reg":
        if "name" not in values:
            raise UsageError(f"--inject {text!r}: reg needs name=REGISTER")
        if ("value" in values) == ("bits" in values):
            raise UsageError(f"--inject {text!r}: reg needs value=V or bits=N (one of them)")
        args["register"] = values["name"]
    else:
        if ("symbol" in values) == ("addr" in values):
            raise UsageError(f"--inject {text!r}: {kind} needs symbol=NAME or addr=ADDRESS (one of them)")
        args["symbol"] = values.get("symbol", "")
        if "addr" in values:
            args["addr"] = _int(text, "addr", values["addr"])
        if kind == "set" and "value" not in values:
            raise UsageError(f"--inject {text!r}: set needs value=V")
    spec = FaultSpec(**args)
    if spec.bits < 1 or spec.size < 0 or (spec.kind == "set" and spec.size not in (0, 1, 2, 4, 8)):
        raise UsageError(f"--inject {text!r}: bits must be >= 1, size 1, 2, 4 or 8 for set")
    return spec


# --- making faults ------------------------------------------------------------------

def _choose_bits(nbits: int, width: int, rng: random.Random, spec: str) -> list[int]:
    if nbits > width:
        raise UsageError(f"--inject {spec!r}: {nbits} bits asked of a {width}-bit target")
    return sorted(rng.sample(range(width), nbits))


def flip_bits(proc, address: int, size: int, nbits: int, rng: random.Random, *,
              spec: str = "flip", target: str = "") -> Fault:
    """Flip `nbits` distinct bits, chosen by `rng`, among the `size` bytes at `address`."""
    before = proc.read(address, size)
    bits = _choose_bits(nbits, size * 8, rng, spec)
    after = bytearray(before)
    for b in bits:
        after[b // 8] ^= 1 << (b % 8)
    proc.write(address, bytes(after))
    return Fault(spec, proc.vpid, target or f"{address:#x}", address, tuple(bits), before.hex(), after.hex())


def set_value(proc, address: int, value: int, size: int = 8, *, spec: str = "set", target: str = "") -> Fault:
    """Write `value` as a little-endian integer of `size` bytes at `address`."""
    before = proc.read(address, size)
    after = (value & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
    proc.write(address, after)
    return Fault(spec, proc.vpid, target or f"{address:#x}", address, (), before.hex(), after.hex())


def _write_register(proc, name: str, tid: int, spec: str, change: Callable[[int], int],
                    bits: tuple[int, ...] = ()) -> Fault:
    """Register `name` of thread `tid` (the leader for 0) becomes change(its value)."""
    regs = proc.registers(tid or None)
    if name not in regs:
        raise UsageError(f"--inject {spec!r}: no register {name!r} (one of {', '.join(regs)})")
    new = change(regs[name]) & (2**64 - 1)
    proc.set_registers(tid or None, **{name: new})
    return Fault(spec, proc.vpid, f"register {name} of {tid or proc.vpid}", 0, bits,
                 f"{regs[name]:#x}", f"{new:#x}")


def flip_register(proc, name: str, nbits: int, rng: random.Random, tid: int = 0, *, spec: str = "reg") -> Fault:
    bits = tuple(_choose_bits(nbits, 64, rng, spec))
    mask = sum(1 << b for b in bits)
    return _write_register(proc, name, tid, spec, lambda old: old ^ mask, bits)


def set_register(proc, name: str, value: int, tid: int = 0, *, spec: str = "reg") -> Fault:
    return _write_register(proc, name, tid, spec, lambda _old: value)


def at_call(proc, spec: FaultSpec, rng: random.Random, record: Callable[[Fault], None]) -> None:
    """A breakpoint on spec.function (restored event): at its spec.n-th call the fault is
    made and passed to `record`, and the breakpoint goes."""
    def callback(hit) -> bool:
        if hit.number < spec.n:
            return True
        where = f"call {hit.number} of {spec.function}"
        if spec.arg is not None:
            before = hit.arg(spec.arg)
            hit.set_arg(spec.arg, spec.value)
            record(Fault(spec.text, proc.vpid, f"{where}: argument {spec.arg}", 0, (), f"{before:#x}",
                         f"{hit.arg(spec.arg):#x}"))
        elif spec.ret is not None:
            def returned(ret) -> None:
                before = ret.result
                ret.set_result(spec.ret)
                record(Fault(spec.text, proc.vpid, f"{where}: return value", 0, (), f"{before:#x}",
                             f"{ret.result:#x}"))
            hit.on_return(returned)
        else:
            flip = FaultSpec(spec.text, "flip", symbol=spec.flip, bits=spec.bits, size=spec.size)
            fault = inject(hit.proc, flip, rng)
            record(dataclasses.replace(fault, pid=proc.vpid, target=f"{where}: {fault.target}"))
        return False
    proc.break_at(spec.function, callback)


def inject(proc, spec: FaultSpec, rng: random.Random) -> Fault:
    """Make the fault `spec` asks for in `proc` (stopped: the restored event)."""
    if spec.kind == "reg":
        if spec.value is not None:
            return set_register(proc, spec.register, spec.value, spec.tid, spec=spec.text)
        return flip_register(proc, spec.register, spec.bits, rng, spec.tid, spec=spec.text)
    if spec.symbol:
        (address, known), target = proc.symbol_extent(spec.symbol), spec.symbol
    else:
        address, target, known = spec.addr, f"{spec.addr:#x}", 0
    if spec.kind == "flip":
        size = spec.size or known or 8
        return flip_bits(proc, address, size, spec.bits, rng, spec=spec.text, target=target)
    size = spec.size or (known if known in (1, 2, 4) else 8)
    return set_value(proc, address, spec.value, size, spec=spec.text, target=target)
