//! Device memory taken by CUDA arrays, from their descriptors.
//!
//! The logical size: width x height x depth (layers, or 6 faces of a cube map, are in depth) x
//! channels x element size, summed over the levels of a mipmapped array. The driver adds alignment
//! and tiling on top, which is not counted. Formats other than the eight classic integer and float
//! ones (video, block-compressed, packed normalised formats of newer CUDA versions) are counted at
//! 16 bytes per element, the largest element of any format: over-counting is the safe side.

/// Bytes per element of `format` with `channels` channels.
fn element_bytes(format: u32, channels: u32) -> u64 {
    let per_channel = match format {
        0x01 | 0x08 => 1,        // CU_AD_FORMAT_UNSIGNED_INT8, SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // UNSIGNED_INT16, SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // UNSIGNED_INT32, SIGNED_INT32, FLOAT
        _ => return 16,
    };
    per_channel * u64::from(channels.clamp(1, 4))
}

/// Bytes of one array level (a zero height or depth means the dimension is absent). Saturates at
/// `u64::MAX`, which no limit admits.
pub fn array_bytes(width: u64, height: u64, depth: u64, format: u32, channels: u32) -> u64 {
    [height.max(1), depth.max(1), element_bytes(format, channels)]
        .into_iter()
        .try_fold(width, u64::checked_mul)
        .unwrap_or(u64::MAX)
}

/// Bytes of a mipmapped array of `levels` levels, each half the previous one in every present
/// dimension (at least 1).
pub fn mipmapped_bytes(width: u64, height: u64, depth: u64, format: u32, channels: u32, levels: u32) -> u64 {
    let shrink = |x: u64, level: u32| if x == 0 { 0 } else { (x >> level).max(1) };
    (0..levels.min(64)).fold(0u64, |sum, level| {
        sum.saturating_add(array_bytes(
            shrink(width, level),
            shrink(height, level),
            shrink(depth, level),
            format,
            channels,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays() {
        assert_eq!(array_bytes(100, 0, 0, 0x01, 1), 100);
        assert_eq!(array_bytes(100, 10, 0, 0x20, 4), 16_000);
        assert_eq!(array_bytes(8, 8, 6, 0x10, 2), 8 * 8 * 6 * 4);
        assert_eq!(
            array_bytes(10, 1, 1, 0xb0, 1),
            160,
            "unknown formats count 16 bytes an element"
        );
        assert_eq!(array_bytes(u64::MAX, 2, 0, 0x01, 1), u64::MAX);
    }

    #[test]
    fn mipmaps() {
        // 8x4, 4x2, 2x1, 1x1 of one float.
        assert_eq!(mipmapped_bytes(8, 4, 0, 0x20, 1, 4), (32 + 8 + 2 + 1) * 4);
        assert_eq!(mipmapped_bytes(16, 0, 0, 0x01, 1, 3), 16 + 8 + 4);
        assert_eq!(mipmapped_bytes(16, 0, 0, 0x01, 1, 0), 0);
    }
}
