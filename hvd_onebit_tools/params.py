"""The click parameter types every `hvd-onebit` command shares."""
from __future__ import annotations

import math

import click


class Finite(click.FloatRange):
    """``click.FloatRange`` that also refuses nan, and inf unless ``allow_inf`` (which a range
    lets through when it has no bound on that side, and nan always); ``priced``: (least, most)
    finite values the command can price, checked after the range (None: no bound)."""

    def __init__(self, *args, allow_inf: bool = False, priced=(None, None), **kwargs):
        super().__init__(*args, **kwargs)
        self.allow_inf, self.priced = allow_inf, priced

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if math.isnan(number) or (math.isinf(number) and not self.allow_inf):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        number = super().convert(number, param, ctx)
        least, most = self.priced
        if math.isfinite(number) and ((least is not None and number < least) or
                                      (most is not None and number > most)):
            bounds = (f"at most {most:g}" if least is None else f"at least {least:g}"
                      if most is None else f"from {least:g} to {most:g}")
            self.fail(f"{number:g} is beyond what the model prices ({bounds})", param, ctx)
        return number
