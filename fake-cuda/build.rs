//! Links the fake driver like the real one: soname `libcuda.so.1` (so that
//! `dlopen("libcuda.so.1", RTLD_NOLOAD)` finds it however it was loaded), and its references to its
//! own functions bound inside it (`-Bsymbolic-functions`), so that the addresses `cuGetProcAddress`
//! hands out are the driver's own even when a preloaded library exports the same names.
fn main() {
    println!("cargo::rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo::rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
}
