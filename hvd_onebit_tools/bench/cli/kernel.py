"""`hvd-onebit bench dev kernel`: the compression kernels' throughput against torch.add."""
from __future__ import annotations

import click

from ..report import print_table, report_head
from .options import comma_list, emit, np_option, out_option, positive_count


@click.command("kernel")
@click.option("--numel", default=None,
              callback=lambda c, p, v: v and comma_list(positive_count)(c, p, v),
              help="Elements in the buffer (e.g. 1M, 16M; binary suffixes: 1M is 1,048,576); with "
                   "--device cuda a list "
                   "[default: 16M on cpu, 16M,64M,128M,256M on cuda].")
@np_option(4, "World size: chunks in the layout (no ranks are launched).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(min=1),
              help="torch threads.")
@click.option("--repeats", default=9, show_default=True, type=click.IntRange(min=1),
              help="Timed runs; the median is kept.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: native and torch kernels; cuda: the Triton (and torch) kernels.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@out_option
def bench_kernel(numel, np_: int, threads: int, repeats: int, device: str,
                 as_json: bool, out) -> None:
    """Compression-kernel throughput as a ratio to torch.add(x, e, out=y) (target >= 0.5)."""
    from ..kernel import bench_kernels, bench_kernels_cuda

    if device == "cuda":
        try:
            result = bench_kernels_cuda(numel or [16 << 20, 64 << 20, 128 << 20, 256 << 20],
                                        ranks=np_, repeats=repeats)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from exc
        result = {**report_head("kernel"), **result}
        if emit(result, as_json, out):
            return
        for e in result["sizes"]:  # the rate `bench predict --kernel-speedup` is taken from
            click.echo(f"{e['numel']} fp32 elements on {result['device_name']}: torch.add "
                       f"{e['add_elems_per_s'] / 1e9:.2f} G elements/s, "
                       f"{e['add_bytes_per_s'] / 1e9:.1f} GB/s")
        print_table([{"numel": e["numel"], "backend": backend, "kernel": k[:-len("_ratio_to_add")],
                      "ratio": v, "gb_s": r[k[:-len("_ratio_to_add")] + "_bytes_per_s"] / 1e9}
                     for e in result["sizes"] for backend, r in e["backends"].items()
                     for k, v in r.items() if k.endswith("_ratio_to_add")],
                    [("numel", "numel", ""), ("backend", "backend", ""), ("kernel", "kernel", ""),
                     ("ratio to add", "ratio", ".2f"), ("GB/s", "gb_s", ".1f")])
        return
    if numel and len(numel) > 1:
        raise click.BadParameter("one size on cpu (a list only with --device cuda)",
                                 param_hint="--numel")
    numel = numel[0] if numel else 16 << 20
    result = bench_kernels(numel=numel, ranks=np_, threads=threads, repeats=repeats)
    result = {**report_head("kernel"), **result}
    if emit(result, as_json, out):
        return
    click.echo(f"{numel} fp32 elements, {np_} chunks, {threads} thread(s); "
               f"torch.add: {result['add_elems_per_s'] / 1e9:.2f} G elements/s, "
               f"{result['add_bytes_per_s'] / 1e9:.1f} GB/s")
    rows = []
    for backend, b in result["backends"].items():
        for k in (k[:-len("_ratio_to_add")] for k in b if k.endswith("_ratio_to_add")):
            rows.append({"backend": backend, "kernel": k,
                         "melem_s": b[f"{k}_elems_per_s"] / 1e6, "ratio": b[f"{k}_ratio_to_add"],
                         "gb_s": b[f"{k}_bytes_per_s"] / 1e9})
    print_table(rows, [("backend", "backend", ""), ("kernel", "kernel", ""),
                       ("M elem/s", "melem_s", ",.0f"), ("ratio to add", "ratio", ".2f"),
                       ("GB/s", "gb_s", ".1f")])
    fused = result.get("fused_optimizer_passes")
    if fused:
        click.echo(f"optimizer passes (native): momentum+compress {fused['momentum_compress_ms']:.1f}"
                   f" ms vs lerp then compress {fused['lerp_then_compress_ms']:.1f} ms "
                   f"({fused['momentum_compress_speedup']:.2f}x); decode+update "
                   f"{fused['decode_update_ms']:.1f} ms vs decode then addcdiv "
                   f"{fused['decode_then_addcdiv_ms']:.1f} ms ({fused['decode_update_speedup']:.2f}x)")
    refresh = result.get("refresh_passes")
    if refresh:
        click.echo("a refresh's passes (native, fused vs separate): " + "; ".join(
            f"{k} {refresh[k + '_ms']:.1f} ms vs {refresh[k + '_separate_ms']:.1f} ms "
            f"({refresh[k + '_speedup']:.2f}x, {refresh[k + '_ratio_to_add']:.2f} of add, "
            f"{refresh[k + '_bytes_per_s'] / 1e9:.1f} GB/s)"
            for k in ("moments", "errors")))
