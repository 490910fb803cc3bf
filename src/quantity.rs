//! Kubernetes resource quantities (`5k`, `1.5Gi`, `500m`, `5e3`), read as the API server reads them
//! (`resource.ParseQuantity` in k8s.io/apimachinery), with integer arithmetic only.
//!
//! The grammar, as apimachinery's scanner takes it: an optional sign, digits with an optional `.` and
//! fraction (either side may be empty: `5.`, `.5`), then one suffix: binary `Ki Mi Gi Ti Pi Ei`,
//! decimal `n u m k M G T P E` or none, or a decimal exponent, `e` or `E` and a signed integer
//! (`5e3`, `1E-3`; a lone `E` is exa). Nothing else: no whitespace, no `K`. As there, a lone sign or
//! `.` reads as zero.
//!
//! A value is kept as the API server keeps it: rounded up to whole nano-units, a binary one capped at
//! 2^63-1. The API server writes a quantity back in canonical form, `5000` as `5k`
//! ([`Quantity::stored`]): readers must take every form, which is why there is one parser.

/// A parsed quantity.
#[derive(Debug, Clone, Copy)]
pub struct Quantity {
    negative: bool,
    /// The magnitude in nano-units (10^-9), below [`MAX_NANOS`].
    nanos: u128,
    format: Format,
    /// Whether the API server keeps the text as written (see [`Quantity::stored`]).
    keeps_text: bool,
}

/// How a quantity was written, which is how the API server writes it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    DecimalSi,
    BinarySi,
    DecimalExponent,
}

/// Why a text is not a quantity, or not the kind of number asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("empty")]
    Empty,
    #[error("not a quantity: expected a number and an optional suffix, such as 5000, 5k, 1.5Gi, 500m or 5e3")]
    Syntax,
    #[error("unknown suffix {0:?} (known: n u m k M G T P E, Ki Mi Gi Ti Pi Ei, or e and an exponent)")]
    Suffix(String),
    #[error("too large")]
    TooLarge,
    #[error("negative")]
    Negative,
    #[error("not a whole number (extended resources must be whole numbers)")]
    NotWhole,
}

const NANO: u128 = 1_000_000_000;
/// Values are kept below 10^27 (in nano-units, 10^36): enough for any resource, and the canonical
/// rendering's arithmetic cannot overflow.
const MAX_NANOS: u128 = 10u128.pow(36);
/// The cap the API server puts on binary quantities: 2^63-1.
const MAX_BINARY_NANOS: u128 = i64::MAX as u128 * NANO;
const DECIMAL_SUFFIXES: [(&str, i64); 10] = [
    ("n", -9),
    ("u", -6),
    ("m", -3),
    ("", 0),
    ("k", 3),
    ("M", 6),
    ("G", 9),
    ("T", 12),
    ("P", 15),
    ("E", 18),
];
const BINARY_SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];

impl Quantity {
    /// Reads `text` as apimachinery's `ParseQuantity` does (see the module's documentation).
    pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
        let bytes = text.as_bytes();
        let Some(&first) = bytes.first() else {
            return Err(QuantityError::Empty);
        };
        let negative = first == b'-';
        let mut pos = usize::from(matches!(first, b'+' | b'-'));
        while bytes.get(pos) == Some(&b'0') {
            pos += 1;
        }
        let num = digits(text, &mut pos);
        let denom = if bytes.get(pos) == Some(&b'.') {
            pos += 1;
            digits(text, &mut pos)
        } else {
            ""
        };
        // The suffix: letters of the suffixes, then an optional signed integer (an exponent's).
        let suffix_start = pos;
        while bytes.get(pos).is_some_and(|b| b"eEinumkKMGTP".contains(b)) {
            pos += 1;
        }
        if matches!(bytes.get(pos), Some(b'+' | b'-')) {
            pos += 1;
        }
        digits(text, &mut pos);
        if pos < bytes.len() {
            return Err(QuantityError::Syntax);
        }
        let (format, exponent) = interpret(&text[suffix_start..])?;

        let mut mantissa: u128 = 0;
        for d in num.bytes().chain(denom.bytes()) {
            mantissa = mantissa
                .checked_mul(10)
                .and_then(|m| m.checked_add(u128::from(d - b'0')))
                .ok_or(QuantityError::TooLarge)?;
        }
        let (twos, tens) = match format {
            Format::BinarySi => (exponent, 0),
            _ => (0, exponent),
        };
        // twos is 0 to 60.
        let scaled = mantissa
            .checked_mul(1u128 << twos)
            .ok_or(QuantityError::TooLarge)?;
        let denom_len = i64::try_from(denom.len()).map_err(|_| QuantityError::TooLarge)?;
        // Saturating: an exponent near i64's ends is far beyond any value anyway.
        let nano_exponent = tens.saturating_sub(denom_len).saturating_add(9);
        let mut nanos = if nano_exponent >= 0 {
            match pow10(nano_exponent.unsigned_abs()) {
                _ if scaled == 0 => 0,
                Some(p) => scaled.checked_mul(p).ok_or(QuantityError::TooLarge)?,
                None => return Err(QuantityError::TooLarge),
            }
        } else {
            // Rounded up to a nano-unit, as the API server does ("you asked for some, you get some");
            // a divisor beyond u128 is beyond any u128 dividend too.
            pow10(nano_exponent.unsigned_abs()).map_or(u128::from(scaled != 0), |p| scaled.div_ceil(p))
        };
        if format == Format::BinarySi {
            nanos = nanos.min(MAX_BINARY_NANOS);
        }
        if nanos >= MAX_NANOS {
            return Err(QuantityError::TooLarge);
        }
        // apimachinery's fast path (few digits, an int64) keeps the text of a quantity that looks
        // canonical; `num` counts as "0" when empty.
        let num_len = num.len().max(1) as i64;
        let keeps_text = match format {
            Format::BinarySi => {
                denom.is_empty()
                    && num_len + exponent * 3 / 10 <= 14
                    && scaled <= i64::MAX as u128
                    && mantissa & 7 != 0
            }
            _ => {
                let scale = exponent.saturating_sub(denom_len);
                num_len + denom_len <= 18
                    && scale >= -9
                    && scale % 3 == 0
                    && !num.is_empty()
                    && !mantissa.is_multiple_of(1000)
            }
        };
        Ok(Quantity {
            negative: negative && nanos != 0,
            nanos,
            format,
            keeps_text,
        })
    }

    fn non_negative(&self) -> Result<u128, QuantityError> {
        if self.negative {
            return Err(QuantityError::Negative);
        }
        Ok(self.nanos)
    }

    /// The value as a count, as extended resources (`nvidia.com/gpu-mem`) are: a whole number, not
    /// negative.
    pub fn whole(&self) -> Result<u64, QuantityError> {
        let nanos = self.non_negative()?;
        if !nanos.is_multiple_of(NANO) {
            return Err(QuantityError::NotWhole);
        }
        u64::try_from(nanos / NANO).map_err(|_| QuantityError::TooLarge)
    }

    /// The value in thousandths, rounded up (CPU in millicores).
    pub fn millis_ceil(&self) -> Result<u64, QuantityError> {
        let nanos = self.non_negative()?;
        u64::try_from(nanos.div_ceil(1_000_000)).map_err(|_| QuantityError::TooLarge)
    }

    /// The value divided by 2^20, rounded up (memory bytes in MiB).
    pub fn mib_ceil(&self) -> Result<u64, QuantityError> {
        let nanos = self.non_negative()?;
        u64::try_from(nanos.div_ceil(NANO << 20)).map_err(|_| QuantityError::TooLarge)
    }

    /// The canonical form (apimachinery's `Quantity.String`): no fraction, the largest suffix of
    /// the written kind that keeps the value exact (`5000` is `5k`, `0.5` is `500m`, `1536Mi` stays,
    /// `1024Mi` is `1Gi`, `5001` stays).
    pub fn canonical(&self) -> String {
        if self.nanos == 0 {
            return "0".into();
        }
        let sign = if self.negative { "-" } else { "" };
        if self.format == Format::BinarySi && self.nanos >= 1024 * NANO && self.nanos.is_multiple_of(NANO) {
            let (mut n, mut e) = (self.nanos / NANO, 0);
            while n.is_multiple_of(1024) && e + 1 < BINARY_SUFFIXES.len() {
                n /= 1024;
                e += 1;
            }
            return format!("{sign}{n}{}", BINARY_SUFFIXES[e]);
        }
        // Decimal (also a binary value below 1024 or with a fraction): the exponent a multiple of 3.
        let (mut n, mut e) = (self.nanos, -9i64);
        while n.is_multiple_of(10) {
            n /= 10;
            e += 1;
        }
        let down = e.rem_euclid(3);
        // n < 10^36 before, at most 100 times that after: within u128.
        n *= 10u128.pow(down as u32);
        e -= down;
        let suffix = match self.format {
            Format::DecimalExponent if e == 0 => String::new(),
            Format::DecimalExponent => format!("e{e}"),
            _ => {
                // Beyond exa the digits carry the rest.
                if e > 18 {
                    n *= 10u128.pow((e - 18) as u32);
                    e = 18;
                }
                let (s, _) = DECIMAL_SUFFIXES
                    .iter()
                    .find(|(_, x)| *x == e)
                    .copied()
                    .unwrap_or_default();
                s.to_string()
            }
        };
        format!("{sign}{n}{suffix}")
    }

    /// The text the API server stores, and returns, for a quantity written as `text`: as written when
    /// apimachinery keeps it (`5001`, `1Ki`, `5e3`, `+1`), else the canonical form (`5000` comes back as
    /// `5k`). Whitespace around it is dropped first, as the API server's JSON decoding does.
    pub fn stored(text: &str) -> Result<String, QuantityError> {
        let text = text.trim();
        let q = Quantity::parse(text)?;
        Ok(if q.keeps_text {
            text.to_string()
        } else {
            q.canonical()
        })
    }
}

/// Advances `pos` over ASCII digits; returns them.
fn digits<'a>(text: &'a str, pos: &mut usize) -> &'a str {
    let start = *pos;
    while text.as_bytes().get(*pos).is_some_and(u8::is_ascii_digit) {
        *pos += 1;
    }
    &text[start..*pos]
}

/// The suffix's format and exponent (of 10, or of 2 for binary suffixes).
fn interpret(suffix: &str) -> Result<(Format, i64), QuantityError> {
    if let Some((_, e)) = DECIMAL_SUFFIXES.iter().find(|(s, _)| *s == suffix) {
        return Ok((Format::DecimalSi, *e));
    }
    if let Some(i) = BINARY_SUFFIXES[1..].iter().position(|s| *s == suffix) {
        return Ok((Format::BinarySi, 10 * (i as i64 + 1)));
    }
    match suffix.strip_prefix(['e', 'E']) {
        Some(exponent) if !exponent.is_empty() => exponent
            .parse()
            .map(|e| (Format::DecimalExponent, e))
            .map_err(|_| QuantityError::Suffix(suffix.into())),
        _ => Err(QuantityError::Suffix(suffix.into())),
    }
}

fn pow10(exponent: u64) -> Option<u128> {
    10u128.checked_pow(u32::try_from(exponent).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (text, exact value in nano-units, or the error).
    fn value(text: &str) -> Result<(bool, u128), QuantityError> {
        Quantity::parse(text).map(|q| (q.negative, q.nanos))
    }

    #[test]
    fn the_grammar_of_apimachinery() {
        let n = |units: u128| Ok((false, units * NANO));
        for (text, want) in [
            ("5k", n(5000)),
            ("12k", n(12000)),
            ("5001", n(5001)),
            ("5000", n(5000)),
            ("5e3", n(5000)),
            ("5E3", n(5000)),
            ("1e+3", n(1000)),
            ("1.5k", n(1500)),
            ("1Ki", n(1024)),
            ("1.5Gi", n(1536 << 20)),
            ("1E", n(10u128.pow(18))),
            ("+1", n(1)),
            ("+5", n(5)),
            ("007", n(7)),
            ("5.", n(5)),
            ("0", n(0)),
            ("-0", n(0)),
            ("0.5", Ok((false, NANO / 2))),
            (".5", Ok((false, NANO / 2))),
            ("500m", Ok((false, NANO / 2))),
            ("1e-3", Ok((false, NANO / 1000))),
            ("1n", Ok((false, 1))),
            ("-1", Ok((true, NANO))),
            ("-1.5Gi", Ok((true, (1536 << 20) * NANO))),
            // Below a nano-unit rounds up to one, as the API server rounds.
            ("0.1n", Ok((false, 1))),
            ("1e-30", Ok((false, 1))),
            ("1e-9223372036854775808", Ok((false, 1))),
            // A lone sign or point is zero in apimachinery's scanner.
            ("+", n(0)),
            (".", n(0)),
            // The API server caps binary quantities at 2^63-1.
            ("8Ei", Ok((false, MAX_BINARY_NANOS))),
        ] {
            assert_eq!(value(text), want, "{text:?}");
        }
        for (text, want) in [
            ("", QuantityError::Empty),
            (" 5", QuantityError::Syntax),
            ("5 ", QuantityError::Syntax),
            ("1.1.M", QuantityError::Syntax),
            ("1+1.0M", QuantityError::Syntax),
            ("aoeu", QuantityError::Syntax),
            ("5x", QuantityError::Syntax),
            ("1e3e", QuantityError::Syntax),
            ("1K", QuantityError::Suffix("K".into())),
            ("1k3", QuantityError::Suffix("k3".into())),
            ("1i", QuantityError::Suffix("i".into())),
            (".5i", QuantityError::Suffix("i".into())),
            ("0.1mi", QuantityError::Suffix("mi".into())),
            ("1e", QuantityError::Suffix("e".into())),
            ("1e+", QuantityError::Suffix("e+".into())),
            ("-3.01e-", QuantityError::Suffix("e-".into())),
            ("1ee3", QuantityError::Suffix("ee3".into())),
            ("99999999999999999999E", QuantityError::TooLarge),
            ("1e27", QuantityError::TooLarge),
            ("1e9223372036854775807", QuantityError::TooLarge),
            (
                "1e99999999999999999999",
                QuantityError::Suffix("e99999999999999999999".into()),
            ),
            (
                "1234567890123456789012345678901234567890",
                QuantityError::TooLarge,
            ),
        ] {
            assert_eq!(value(text), Err(want), "{text:?}");
        }
    }

    #[test]
    fn counts_are_whole_and_not_negative() {
        let whole = |t: &str| Quantity::parse(t).and_then(|q| q.whole());
        assert_eq!(whole("5k"), Ok(5000));
        assert_eq!(whole("5e3"), Ok(5000));
        assert_eq!(whole("1Ki"), Ok(1024));
        assert_eq!(whole("0.5k"), Ok(500));
        assert_eq!(whole("18E"), Ok(18 * 10u64.pow(18)));
        assert_eq!(whole("1.5"), Err(QuantityError::NotWhole));
        assert_eq!(whole("500m"), Err(QuantityError::NotWhole));
        assert_eq!(whole("-1"), Err(QuantityError::Negative));
        assert_eq!(whole("20E"), Err(QuantityError::TooLarge));
        assert_eq!(
            QuantityError::NotWhole.to_string(),
            "not a whole number (extended resources must be whole numbers)"
        );
    }

    #[test]
    fn cpu_and_memory_round_up() {
        let milli = |t: &str| Quantity::parse(t).and_then(|q| q.millis_ceil());
        let mib = |t: &str| Quantity::parse(t).and_then(|q| q.mib_ceil());
        assert_eq!(milli("3500m"), Ok(3500));
        assert_eq!(milli("2"), Ok(2000));
        assert_eq!(milli("0.5"), Ok(500));
        assert_eq!(milli("1u"), Ok(1));
        assert_eq!(milli("-1"), Err(QuantityError::Negative));
        assert_eq!(mib("16Gi"), Ok(16384));
        assert_eq!(mib("1048576"), Ok(1));
        assert_eq!(mib("1048577"), Ok(2));
        assert_eq!(mib("1e9"), Ok(954));
        assert_eq!(mib("1Ki"), Ok(1));
        assert_eq!(mib("1.5Gi"), Ok(1536));
    }

    #[test]
    fn stored_as_the_api_server_writes_it_back() {
        for (written, stored) in [
            ("5000", "5k"),
            ("12000", "12k"),
            ("5001", "5001"),
            ("1000000", "1M"),
            ("0", "0"),
            ("00", "0"),
            ("100", "100"),
            ("50000", "50k"),
            ("1500", "1500"),
            ("1.5k", "1500"),
            ("0.5", "500m"),
            ("500m", "500m"),
            ("0.1m", "100u"),
            ("1.5Gi", "1536Mi"),
            ("1536Mi", "1536Mi"),
            ("1024Mi", "1Gi"),
            ("1Ki", "1Ki"),
            ("0.5Ki", "512"),
            ("512Mi", "512Mi"),
            ("5e3", "5e3"),
            ("1e4", "10e3"),
            ("1e3", "1e3"),
            ("1000e0", "1e3"),
            ("+1", "+1"),
            ("-1", "-1"),
            ("-5000", "-5k"),
            (" 5000 ", "5k"),
            ("1000E", "1000E"),
        ] {
            assert_eq!(Quantity::stored(written).as_deref(), Ok(stored), "{written:?}");
        }
    }

    #[test]
    fn the_canonical_form_reads_back_as_the_same_value() {
        for text in [
            "5000",
            "5001",
            "12000",
            "0.5",
            "1.5Gi",
            "1024Mi",
            "1e4",
            "7n",
            "123456789",
            "0.5Ki",
            "1000E",
        ] {
            let q = Quantity::parse(text).unwrap();
            let again = Quantity::parse(&q.canonical()).unwrap();
            assert_eq!((again.negative, again.nanos), (q.negative, q.nanos), "{text:?}");
            assert_eq!(again.canonical(), q.canonical(), "{text:?}");
        }
        for units in [
            0u64,
            1,
            999,
            1000,
            5000,
            5001,
            12000,
            1_000_000,
            1_000_001,
            u64::MAX,
        ] {
            let canonical = Quantity::parse(&units.to_string()).unwrap().canonical();
            assert_eq!(
                Quantity::parse(&canonical).and_then(|q| q.whole()),
                Ok(units),
                "{canonical}"
            );
        }
    }
}
