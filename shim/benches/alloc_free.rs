//! Cost of a cuMemAlloc_v2 + cuMemFree_v2 pair with `libgpumem_cuda.so` enforcing a limit (and in
//! pass-through), against the same program without it, over the fake driver.
//!
//! `cargo bench -p gpumem-cuda-shim --bench alloc_free` (builds the shim and the fake with the
//! bench profile, compiles `tests/c/bench.c`, runs it in each configuration, interleaved, and
//! prints nanoseconds per pair, the difference, and the ratio). Target: < 100 ns added per pair.

#[path = "../tests/support/mod.rs"]
#[allow(dead_code)]
mod support;

use support::{Shim, accounting_dir, bench_program, command, run, stdout};

/// (best, median) ns per pair of one run.
fn measure(shim: &Shim<'_>, rounds: u32, pairs: u32) -> (f64, f64) {
    let mut cmd = command(&bench_program(), shim);
    cmd.args([rounds.to_string(), pairs.to_string()]);
    let out = stdout(&run(cmd));
    let field = |name: &str| -> f64 {
        out.split_whitespace()
            .find_map(|f| f.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("unexpected bench output: {out}"))
    };
    (field("min="), field("median="))
}

fn main() {
    // `cargo test --benches` runs this with `--test`-less args too; keep that quick.
    let quick = std::env::args().any(|a| a == "--test" || a == "--list");
    let (repeats, rounds, pairs) = if quick { (1, 2, 1000) } else { (5, 15, 200_000) };
    let dir = accounting_dir();
    let configs = [
        ("without the shim", Shim::off()),
        ("shim, no limit (pass-through)", Shim::passthrough()),
        (
            "shim enforcing 64 GiB, shared file",
            Shim::limit("65536", Some(dir.path())),
        ),
    ];
    let mut best = [f64::MAX; 3];
    let mut medians = [f64::MAX; 3];
    for _ in 0..repeats {
        for (i, (_, shim)) in configs.iter().enumerate() {
            let (min, median) = measure(shim, rounds, pairs);
            best[i] = best[i].min(min);
            medians[i] = medians[i].min(median);
        }
    }
    println!(
        "cuMemAlloc_v2 + cuMemFree_v2 (1 MiB), fake driver, ns per pair ({repeats} runs x {rounds} rounds x {pairs} pairs):"
    );
    for (i, (name, _)) in configs.iter().enumerate() {
        let added = best[i] - best[0];
        println!(
            "  {name:38} best {:7.1}  median {:7.1}  added {added:6.1}  ratio {:.2}",
            best[i],
            medians[i],
            best[i] / best[0]
        );
    }
}
