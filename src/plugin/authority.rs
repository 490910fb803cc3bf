//! Makes the device-plugin sockets answer kubelets older than 1.26: a transport adapter that
//! rewrites an HTTP/2 `:authority` h2 would reject to `localhost` on the way in.
//!
//! grpc-go (kubelets before 1.26, kubernetes/kubernetes#112597), grpc-java and grpc-python send a
//! unix socket's *path* as `:authority`. h2's server parses that header with
//! `http::uri::Authority` and resets the stream with PROTOCOL_ERROR when it fails
//! (hyperium/h2#487), so such a kubelet never gets past `GetDevicePluginOptions` and the node never
//! shows the resources. [`AuthorityRewrite::new`] wraps every accepted connection: it follows the
//! client's frames, HPACK-decodes every header block with a decoder that mirrors the client's
//! encoder, replaces an invalid `:authority`, and re-encodes the block without the dynamic table
//! (so h2's decoder state never depends on the client's). Every other byte, and the whole write
//! side, passes through untouched; a stream that does not start with the HTTP/2 preface is passed
//! through unchanged, and a header block that does not parse closes the connection with a warning.
//!
//! [`AuthorityRewrite::with_authority`] is the same machinery the other way round: wrapped around
//! a client's bytes it makes an h2 client (which can only send a valid authority) send any
//! `:authority`, encoded the way grpc-go encodes it. The tests' kubelet double uses it to send the
//! socket path like a kubelet before 1.26.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use loona_hpack::Decoder;
use loona_hpack::encoder::encode_integer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// HEADERS/CONTINUATION we write stay within SETTINGS_MAX_FRAME_SIZE's default, which is what
/// h2 (through hyper and tonic) advertises unless configured otherwise.
const MAX_FRAME_PAYLOAD: usize = 16_384;
/// SETTINGS_HEADER_TABLE_SIZE as h2 advertises it (the default: hyper sets none): the most the
/// client's encoder, and so our decoder, may grow its dynamic table to.
const H2_HEADER_TABLE_SIZE: usize = 4_096;
/// Bounds a header block's encoded and decoded size, to bound memory per connection. Far above
/// any real request: hyper advertises a 16 KiB header-list limit.
const MAX_BLOCK: usize = 1 << 20;
/// What replaces an `:authority` h2 would reject (what kubelets since 1.26 send).
const LOCALHOST: &[u8] = b"localhost";
/// HPACK index of the first dynamic-table entry (RFC 7541 §2.3.3).
const FIRST_DYNAMIC_INDEX: usize = 62;
/// HPACK's per-entry overhead in the dynamic table's size (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;
/// How much is read from the socket at a time.
const READ_CHUNK: usize = 16 * 1024;

/// Why a connection's byte stream cannot be rewritten (the connection is then closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("frame type {kind:#x} on stream {stream} inside the header block of stream {open}")]
    ExpectedContinuation { kind: u8, stream: u32, open: u32 },
    #[error("HEADERS frame on stream {stream} too short for its padding and priority fields")]
    BadPadding { stream: u32 },
    #[error("header block of stream {stream} larger than {MAX_BLOCK} bytes")]
    TooLarge { stream: u32 },
    #[error("header block of stream {stream} does not decode: {reason}")]
    Hpack { stream: u32, reason: String },
}

/// A connection whose client → server bytes go through [`Rewriter`]; see the module doc.
pub struct AuthorityRewrite<IO> {
    io: IO,
    rewriter: Rewriter,
    /// Rewritten bytes not yet handed to the reader: `out[pos..]`.
    out: Vec<u8>,
    pos: usize,
    scratch: Box<[u8]>,
    /// Set once the input could not be rewritten: every later read fails with it.
    failed: Option<Malformed>,
}

impl<IO> AuthorityRewrite<IO> {
    /// Replaces an `:authority` that h2 would reject with `localhost` and leaves a valid one alone:
    /// what a server wraps around the connections it accepts.
    pub fn new(io: IO) -> Self {
        Self::with_rule(io, Rule::Repair)
    }

    /// Replaces every `:authority` with `authority`, whatever the client sent, valid or not (a
    /// request without one keeps none). As grpc-go does, the first request adds it to the HPACK
    /// dynamic table and later ones refer to it by index, so the server has to follow the
    /// client's table to read it. Assumes the server keeps HPACK's default 4 KiB table, as h2 does.
    pub fn with_authority(io: IO, authority: impl Into<Vec<u8>>) -> Self {
        Self::with_rule(
            io,
            Rule::Replace {
                authority: authority.into(),
                in_table: false,
            },
        )
    }

    fn with_rule(io: IO, rule: Rule) -> Self {
        Self {
            io,
            rewriter: Rewriter::new(rule),
            out: Vec::new(),
            pos: 0,
            scratch: vec![0; READ_CHUNK].into_boxed_slice(),
            failed: None,
        }
    }
}

impl<IO: Connected> Connected for AuthorityRewrite<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityRewrite<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.pos < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.pos);
                buf.put_slice(&this.out[this.pos..this.pos + n]);
                this.pos += n;
                if this.pos == this.out.len() {
                    this.out.clear();
                    this.pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if let Some(err) = &this.failed {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::InvalidData, err.clone())));
            }
            let mut chunk = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.io).poll_read(cx, &mut chunk))?;
            if chunk.filled().is_empty() {
                // EOF; a frame cut short is dropped, which h2 would reject anyway.
                return Poll::Ready(Ok(()));
            }
            if let Err(err) = this.rewriter.feed(chunk.filled(), &mut this.out) {
                tracing::warn!(error = %err, "closing a device-plugin connection: cannot rewrite its HTTP/2 headers");
                this.failed = Some(err);
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityRewrite<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Where the parser is in the client's byte stream.
enum State {
    /// Matching the preface; this many bytes of it seen.
    Preface(usize),
    /// Collecting a frame header.
    FrameHeader {
        head: [u8; FRAME_HEADER_LEN],
        have: usize,
    },
    /// Copying this many more payload bytes of a frame that passes through.
    Copy(usize),
    /// Collecting the payload of a HEADERS or CONTINUATION frame into `payload`.
    HeaderPayload {
        kind: u8,
        flags: u8,
        stream: u32,
        remaining: usize,
    },
    /// Not HTTP/2: everything passes through unchanged.
    Transparent,
}

/// The state at a frame boundary.
const NEXT_FRAME: State = State::FrameHeader {
    head: [0; FRAME_HEADER_LEN],
    have: 0,
};

/// A header block being collected (HEADERS, then CONTINUATION until END_HEADERS).
struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// What happens to a request's `:authority`.
enum Rule {
    /// One h2 would reject becomes `localhost`.
    Repair,
    /// Every one becomes `authority`; `in_table` once it is the dynamic table's first entry (it
    /// stays there: nothing else is ever added).
    Replace { authority: Vec<u8>, in_table: bool },
}

/// The client → server byte stream transformation, apart from any I/O.
pub(crate) struct Rewriter {
    rule: Rule,
    state: State,
    payload: Vec<u8>,
    block: Option<Block>,
    /// Mirrors the client's HPACK encoder.
    decoder: Decoder<'static>,
    /// Whether this connection's rewrite was logged at info already.
    logged: bool,
}

impl Rewriter {
    fn new(rule: Rule) -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(H2_HEADER_TABLE_SIZE);
        Self {
            rule,
            state: State::Preface(0),
            payload: Vec::new(),
            block: None,
            decoder,
            logged: false,
        }
    }

    /// Consumes all of `input`, appending what h2 should read to `out`. After an error the
    /// stream cannot be followed any more: the caller closes the connection.
    pub(crate) fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<(), Malformed> {
        while !input.is_empty() {
            match &mut self.state {
                State::Transparent => {
                    out.extend_from_slice(input);
                    return Ok(());
                }
                State::Preface(seen) => {
                    let want = &PREFACE[*seen..];
                    let n = want.len().min(input.len());
                    if input[..n] != want[..n] {
                        tracing::info!(
                            "device-plugin connection does not start with the HTTP/2 preface: passing it through unchanged"
                        );
                        // What matched so far has been copied already.
                        self.state = State::Transparent;
                        continue;
                    }
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    *seen += n;
                    if *seen == PREFACE.len() {
                        self.state = NEXT_FRAME;
                    }
                }
                State::FrameHeader { head, have } => {
                    let n = (FRAME_HEADER_LEN - *have).min(input.len());
                    head[*have..*have + n].copy_from_slice(&input[..n]);
                    *have += n;
                    input = &input[n..];
                    if *have == FRAME_HEADER_LEN {
                        let head = *head;
                        self.frame_header(head, out)?;
                    }
                }
                State::Copy(remaining) => {
                    let n = (*remaining).min(input.len());
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    *remaining -= n;
                    if *remaining == 0 {
                        self.state = NEXT_FRAME;
                    }
                }
                State::HeaderPayload {
                    kind,
                    flags,
                    stream,
                    remaining,
                } => {
                    let n = (*remaining).min(input.len());
                    self.payload.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    *remaining -= n;
                    if *remaining == 0 {
                        let (kind, flags, stream) = (*kind, *flags, *stream);
                        self.state = NEXT_FRAME;
                        self.header_frame(kind, flags, stream, out)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn frame_header(&mut self, head: [u8; FRAME_HEADER_LEN], out: &mut Vec<u8>) -> Result<(), Malformed> {
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
        let (kind, flags) = (head[3], head[4]);
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        if let Some(block) = &self.block {
            // RFC 9113 §6.10: nothing but this stream's CONTINUATION until END_HEADERS.
            if kind != TYPE_CONTINUATION || stream != block.stream {
                return Err(Malformed::ExpectedContinuation {
                    kind,
                    stream,
                    open: block.stream,
                });
            }
            if block.fragment.len() + len > MAX_BLOCK {
                return Err(Malformed::TooLarge { stream });
            }
        }
        // A stray CONTINUATION passes through: h2 rejects it as the protocol error it is.
        let ours = kind == TYPE_HEADERS || (kind == TYPE_CONTINUATION && self.block.is_some());
        if !ours {
            out.extend_from_slice(&head);
            self.state = if len == 0 { NEXT_FRAME } else { State::Copy(len) };
            return Ok(());
        }
        if len > MAX_BLOCK {
            return Err(Malformed::TooLarge { stream });
        }
        self.payload.clear();
        self.state = State::HeaderPayload {
            kind,
            flags,
            stream,
            remaining: len,
        };
        if len == 0 {
            self.state = NEXT_FRAME;
            self.header_frame(kind, flags, stream, out)?;
        }
        Ok(())
    }

    /// A HEADERS or CONTINUATION frame's payload is complete in `self.payload`.
    fn header_frame(&mut self, kind: u8, flags: u8, stream: u32, out: &mut Vec<u8>) -> Result<(), Malformed> {
        let payload = std::mem::take(&mut self.payload);
        let mut block = match self.block.take() {
            Some(mut block) => {
                block.fragment.extend_from_slice(&payload);
                block
            }
            None => {
                debug_assert_eq!(kind, TYPE_HEADERS);
                // RFC 9113 §6.2: [pad length] [exclusive+dependency, weight] fragment [padding].
                let mut rest = &payload[..];
                let mut pad = 0;
                if flags & FLAG_PADDED != 0 {
                    let (&n, tail) = rest.split_first().ok_or(Malformed::BadPadding { stream })?;
                    pad = usize::from(n);
                    rest = tail;
                }
                let mut priority = None;
                if flags & FLAG_PRIORITY != 0 {
                    let (fields, tail) = rest
                        .split_first_chunk::<5>()
                        .ok_or(Malformed::BadPadding { stream })?;
                    priority = Some(*fields);
                    rest = tail;
                }
                let fragment = rest
                    .get(
                        ..rest
                            .len()
                            .checked_sub(pad)
                            .ok_or(Malformed::BadPadding { stream })?,
                    )
                    .ok_or(Malformed::BadPadding { stream })?;
                Block {
                    stream,
                    end_stream: flags & FLAG_END_STREAM != 0,
                    priority,
                    fragment: fragment.to_vec(),
                }
            }
        };
        if flags & FLAG_END_HEADERS == 0 {
            self.block = Some(block);
            return Ok(());
        }
        let encoded = self.rewrite(&block)?;
        block.fragment = encoded;
        write_block(&block, out);
        Ok(())
    }

    /// Decodes a complete header block, fixes `:authority`, and encodes it again with literals only.
    fn rewrite(&mut self, block: &Block) -> Result<Vec<u8>, Malformed> {
        let stream = block.stream;
        let mut headers = Vec::new();
        // Counted as HPACK counts a header list (RFC 7541 §4.1): indexed fields can make a small
        // block decode into a huge list.
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(&block.fragment, |name, value| {
                size = size.saturating_add(name.len() + value.len() + 32);
                if size <= MAX_BLOCK {
                    headers.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|e| Malformed::Hpack {
                stream,
                reason: e.to_string(),
            })?;
        if size > MAX_BLOCK {
            return Err(Malformed::TooLarge { stream });
        }
        let mut encoded = Vec::with_capacity(block.fragment.len() * 2);
        for (name, value) in &mut headers {
            if name.as_slice() == b":authority" {
                match &mut self.rule {
                    Rule::Repair => {
                        if http::uri::Authority::try_from(value.as_slice()).is_err() {
                            self.log_repair(stream, value);
                            *value = LOCALHOST.to_vec();
                        }
                    }
                    Rule::Replace { authority, in_table } => {
                        if *in_table {
                            // Indexed field (RFC 7541 §6.1).
                            let mut index = encode_integer(FIRST_DYNAMIC_INDEX, 7);
                            index[0] |= 0x80;
                            encoded.extend_from_slice(&index);
                            continue;
                        }
                        if authority.len() + ":authority".len() + ENTRY_OVERHEAD <= H2_HEADER_TABLE_SIZE {
                            // Literal with incremental indexing, name from the static table's
                            // entry 1 (RFC 7541 §6.2.1): the decoder adds it to its table.
                            let mut prefix = encode_integer(1, 6);
                            prefix[0] |= 0x40;
                            encoded.extend_from_slice(&prefix);
                            encoded.extend_from_slice(&encode_integer(authority.len(), 7));
                            encoded.extend_from_slice(authority);
                            *in_table = true;
                            continue;
                        }
                        // Too large for the table: sent as a literal each time.
                        value.clone_from(authority);
                    }
                }
            }
            // Literal without indexing, literal name (RFC 7541 §6.2.2): touches no table on either side.
            encoded.push(0x00);
            for text in [&*name, &*value] {
                encoded.extend_from_slice(&encode_integer(text.len(), 7));
                encoded.extend_from_slice(text);
            }
        }
        Ok(encoded)
    }

    /// Logs a repaired authority: at info the first time on a connection, then at debug.
    fn log_repair(&mut self, stream: u32, original: &[u8]) {
        let original = String::from_utf8_lossy(original).into_owned();
        if self.logged {
            tracing::debug!(stream, original, "rewrote :authority to localhost");
        } else {
            tracing::info!(
                stream,
                original,
                "rewrote an :authority h2 would reject to localhost (kubelets before 1.26 send the socket path)"
            );
            self.logged = true;
        }
    }
}

/// Frames an encoded block as HEADERS (+ CONTINUATION), keeping END_STREAM and the priority fields.
fn write_block(block: &Block, out: &mut Vec<u8>) {
    let first_room = MAX_FRAME_PAYLOAD - if block.priority.is_some() { 5 } else { 0 };
    let split = first_room.min(block.fragment.len());
    let (first, mut rest) = block.fragment.split_at(split);
    let mut flags = 0;
    if block.end_stream {
        flags |= FLAG_END_STREAM;
    }
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    let priority: &[u8] = match &block.priority {
        Some(fields) => {
            flags |= FLAG_PRIORITY;
            fields
        }
        None => &[],
    };
    frame_head(
        priority.len() + first.len(),
        TYPE_HEADERS,
        flags,
        block.stream,
        out,
    );
    out.extend_from_slice(priority);
    out.extend_from_slice(first);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(MAX_FRAME_PAYLOAD.min(rest.len()));
        rest = tail;
        let flags = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
        frame_head(chunk.len(), TYPE_CONTINUATION, flags, block.stream, out);
        out.extend_from_slice(chunk);
    }
}

fn frame_head(len: usize, kind: u8, flags: u8, stream: u32, out: &mut Vec<u8>) {
    // len <= MAX_FRAME_PAYLOAD, so it fits the 24-bit field.
    let len = (len as u32).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOCKET_PATH: &[u8] = b"/var/lib/kubelet/device-plugins/gpumem-gpu.sock";
    /// SOCKET_PATH Huffman-coded (RFC 7541 Appendix B), as grpc-go sends it.
    const SOCKET_PATH_HUFFMAN: &str = "63b8ec628346c75b632d054b1217b98855aba2d98d52189abb692d2b4d5daba0e4eb";

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn string(text: &[u8]) -> Vec<u8> {
        let mut v = encode_integer(text.len(), 7);
        v.extend_from_slice(text);
        v
    }

    /// Literal with incremental indexing, name from the static table (what grpc-go sends).
    fn indexed_name(index: usize, value: &[u8]) -> Vec<u8> {
        let mut v = encode_integer(index, 6);
        v[0] |= 0x40;
        v.extend(string(value));
        v
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        let len = (payload.len() as u32).to_be_bytes();
        v.extend_from_slice(&len[1..]);
        v.extend_from_slice(&[kind, flags]);
        v.extend_from_slice(&stream.to_be_bytes());
        v.extend_from_slice(payload);
        v
    }

    /// The first request grpc-go sends: POST, http, the path, and the socket path as authority.
    fn request_block(authority: &[u8]) -> Vec<u8> {
        let mut b = vec![0x83, 0x86]; // :method POST, :scheme http
        b.extend(indexed_name(4, b"/v1beta1.DevicePlugin/GetDevicePluginOptions"));
        b.extend(indexed_name(1, authority));
        b.extend(indexed_name(31, b"application/grpc"));
        b
    }

    fn settings() -> Vec<u8> {
        frame(0x4, 0, 0, &[0x00, 0x04, 0x00, 0x40, 0x00, 0x00]) // INITIAL_WINDOW_SIZE 4 MiB
    }

    fn run(input: &[u8], chunk: usize) -> Result<Vec<u8>, Malformed> {
        run_with(Rule::Repair, input, chunk)
    }

    fn run_with(rule: Rule, input: &[u8], chunk: usize) -> Result<Vec<u8>, Malformed> {
        let mut rewriter = Rewriter::new(rule);
        let mut out = Vec::new();
        for piece in input.chunks(chunk) {
            rewriter.feed(piece, &mut out)?;
        }
        Ok(out)
    }

    /// Frames of `bytes` after the preface: (type, flags, stream, payload).
    fn frames(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        assert_eq!(&bytes[..24], PREFACE);
        let mut rest = &bytes[24..];
        let mut frames = Vec::new();
        while !rest.is_empty() {
            let len = (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
            let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]);
            frames.push((rest[3], rest[4], stream, rest[9..9 + len].to_vec()));
            rest = &rest[9 + len..];
        }
        frames
    }

    /// Decodes a rewritten block with a FRESH decoder: it must not depend on any table state.
    fn decode_alone(block: &[u8]) -> Vec<(String, String)> {
        let mut decoder = Decoder::new();
        decoder.set_max_table_size(0);
        let headers = decoder.decode(block).expect("rewritten block decodes on its own");
        headers
            .into_iter()
            .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
            .collect()
    }

    fn authority(headers: &[(String, String)]) -> &str {
        &headers
            .iter()
            .find(|(n, _)| n == ":authority")
            .expect(":authority")
            .1
    }

    fn connection(blocks: &[Vec<u8>]) -> Vec<u8> {
        let mut input = PREFACE.to_vec();
        input.extend(settings());
        for (i, block) in blocks.iter().enumerate() {
            input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1 + 2 * i as u32, block));
        }
        input
    }

    #[test]
    fn path_authority_becomes_localhost_across_any_read_boundaries() {
        let mut input = connection(&[request_block(SOCKET_PATH)]);
        let data = frame(0x0, FLAG_END_STREAM, 1, &[0, 0, 0, 0, 0]);
        input.extend(&data);
        let whole = run(&input, input.len()).unwrap();
        for chunk in [1, 2, 7, 9, 10, 33] {
            assert_eq!(run(&input, chunk).unwrap(), whole, "read {chunk} bytes at a time");
        }
        let frames = frames(&whole);
        assert_eq!(frames.len(), 3);
        assert_eq!(
            frames[0],
            (0x4, 0, 0, settings()[9..].to_vec()),
            "SETTINGS passes unchanged"
        );
        let (kind, flags, stream, block) = &frames[1];
        assert_eq!((*kind, *flags, *stream), (TYPE_HEADERS, FLAG_END_HEADERS, 1));
        let headers = decode_alone(block);
        assert_eq!(authority(&headers), "localhost");
        assert_eq!(headers[0], (":method".into(), "POST".into()));
        assert_eq!(
            headers[2],
            (
                ":path".into(),
                "/v1beta1.DevicePlugin/GetDevicePluginOptions".into()
            )
        );
        assert_eq!(headers[4], ("content-type".into(), "application/grpc".into()));
        assert!(whole.ends_with(&data), "DATA passes unchanged");
    }

    #[test]
    fn padded_and_priority_headers() {
        let block = request_block(SOCKET_PATH);
        let priority = [0x80, 0, 0, 0x03, 200]; // exclusive, depends on stream 3, weight 201
        let mut payload = vec![4]; // pad length
        payload.extend(priority);
        payload.extend(&block);
        payload.extend([0; 4]);
        let flags = FLAG_PADDED | FLAG_PRIORITY | FLAG_END_HEADERS | FLAG_END_STREAM;
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, flags, 5, &payload));
        let out = run(&input, 1).unwrap();
        let frames = frames(&out);
        let (kind, flags, stream, payload) = &frames[0];
        assert_eq!(
            (*kind, *flags, *stream),
            (
                TYPE_HEADERS,
                FLAG_PRIORITY | FLAG_END_HEADERS | FLAG_END_STREAM,
                5
            ),
            "padding dropped, priority and END_STREAM kept"
        );
        assert_eq!(payload[..5], priority);
        assert_eq!(authority(&decode_alone(&payload[5..])), "localhost");
    }

    #[test]
    fn padding_longer_than_the_frame_is_refused() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_PADDED | FLAG_END_HEADERS,
            1,
            &[9, 0x83, 0x86],
        ));
        assert_eq!(run(&input, 1), Err(Malformed::BadPadding { stream: 1 }));
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_PRIORITY | FLAG_END_HEADERS, 1, &[0, 0]));
        assert_eq!(run(&input, 3), Err(Malformed::BadPadding { stream: 1 }));
    }

    #[test]
    fn continuation_frames_are_joined() {
        let block = request_block(SOCKET_PATH);
        // Split inside the authority's string.
        let (a, b) = block.split_at(block.len() - 30);
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_END_STREAM, 1, a));
        input.extend(frame(TYPE_CONTINUATION, 0, 1, &b[..10]));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &b[10..]));
        let out = run(&input, 1).unwrap();
        let frames = frames(&out);
        assert_eq!(frames.len(), 1, "one HEADERS frame when the block fits");
        let (kind, flags, _, block) = &frames[0];
        assert_eq!(
            (*kind, *flags),
            (TYPE_HEADERS, FLAG_END_STREAM | FLAG_END_HEADERS)
        );
        assert_eq!(authority(&decode_alone(block)), "localhost");
    }

    #[test]
    fn a_block_over_the_frame_size_is_split_into_continuations() {
        let mut block = request_block(SOCKET_PATH);
        let big = vec![b'x'; 20_000];
        block.push(0x00);
        block.extend(string(b"x-big"));
        block.extend(string(&big));
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_END_STREAM, 1, &block[..10_000]));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &block[10_000..]));
        let frames = frames(&run(&input, 4096).unwrap());
        let kinds: Vec<_> = frames.iter().map(|f| (f.0, f.1)).collect();
        assert_eq!(
            kinds,
            [
                (TYPE_HEADERS, FLAG_END_STREAM),
                (TYPE_CONTINUATION, FLAG_END_HEADERS)
            ]
        );
        assert!(frames.iter().all(|f| f.3.len() <= MAX_FRAME_PAYLOAD));
        let joined: Vec<u8> = frames.iter().flat_map(|f| f.3.clone()).collect();
        let headers = decode_alone(&joined);
        assert_eq!(authority(&headers), "localhost");
        assert_eq!(headers.last().unwrap().1.len(), 20_000);
    }

    #[test]
    fn second_request_indexing_the_dynamic_table_is_rewritten_too() {
        // After the first block the client's table holds, newest first: content-type (62),
        // :authority (63), :path (64). grpc-go's second call refers to them by index.
        let second = vec![0x83, 0x86, 0x80 | 64, 0x80 | 63, 0x80 | 62];
        let out = run(&connection(&[request_block(SOCKET_PATH), second]), 1).unwrap();
        let frames = frames(&out);
        assert_eq!(frames[2].2, 3);
        let headers = decode_alone(&frames[2].3);
        assert_eq!(authority(&headers), "localhost");
        assert_eq!(headers[2].1, "/v1beta1.DevicePlugin/GetDevicePluginOptions");
        assert_eq!(headers[4].1, "application/grpc");
    }

    #[test]
    fn huffman_coded_values() {
        // A Huffman-coded socket path, then RFC 7541 C.4.1 and C.4.2 (www.example.com, then
        // cache-control: no-cache, Huffman-coded, with :authority indexed from the table).
        let mut path = vec![0x83, 0x86, 0x41];
        let coded = hex(SOCKET_PATH_HUFFMAN);
        path.push(0x80 | coded.len() as u8);
        path.extend(coded);
        let c41 = hex("828684418cf1e3c2e5f23a6ba0ab90f4ff");
        let c42 = hex("828684be5886a8eb10649cbf");
        let out = run(&connection(&[path, c41, c42]), 5).unwrap();
        let frames = frames(&out);
        assert_eq!(authority(&decode_alone(&frames[1].3)), "localhost");
        assert_eq!(authority(&decode_alone(&frames[2].3)), "www.example.com");
        let third = decode_alone(&frames[3].3);
        assert_eq!(authority(&third), "www.example.com");
        assert_eq!(third[4], ("cache-control".into(), "no-cache".into()));
    }

    #[test]
    fn a_valid_authority_is_left_alone() {
        for valid in [
            &b"localhost"[..],
            b"localhost:1234",
            b"gpumem-gpu.sock",
            b"[::1]:80",
        ] {
            let out = run(&connection(&[request_block(valid)]), 1).unwrap();
            let headers = decode_alone(&frames(&out)[1].3);
            assert_eq!(authority(&headers).as_bytes(), valid);
        }
    }

    #[test]
    fn table_size_updates_up_to_what_h2_advertises() {
        let mut block = vec![0x3f, 0xe1, 0x1f]; // size update to 4096
        block.extend(request_block(SOCKET_PATH));
        let out = run(&connection(&[block]), 1).unwrap();
        assert_eq!(authority(&decode_alone(&frames(&out)[1].3)), "localhost");

        let mut block = vec![0x3f, 0xe2, 0x1f]; // 4097: more than h2 allows the client
        block.extend(request_block(SOCKET_PATH));
        assert!(matches!(
            run(&connection(&[block]), 1),
            Err(Malformed::Hpack { stream: 1, .. })
        ));
    }

    #[test]
    fn frames_other_than_headers_pass_byte_for_byte() {
        let mut input = PREFACE.to_vec();
        input.extend(settings());
        input.extend(frame(0x4, 0x1, 0, &[])); // SETTINGS ack
        input.extend(frame(0x8, 0, 0, &[0, 0, 0x10, 0])); // WINDOW_UPDATE
        input.extend(frame(0x6, 0, 0, &[1, 2, 3, 4, 5, 6, 7, 8])); // PING
        input.extend(frame(0x0, 0x8, 1, &[2, b'h', b'i', 0, 0])); // padded DATA
        input.extend(frame(0x3, 0, 1, &[0, 0, 0, 8])); // RST_STREAM
        input.extend(frame(0x9, FLAG_END_HEADERS, 7, &[0x82])); // stray CONTINUATION: h2's to reject
        assert_eq!(run(&input, 1).unwrap(), input);
    }

    #[test]
    fn not_http2_passes_unchanged() {
        let input = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(run(input, 1).unwrap(), input);
        // A preface that goes wrong late.
        let input = b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\nrest";
        assert_eq!(run(input, 3).unwrap(), input);
    }

    #[test]
    fn malformed_header_blocks_are_errors_not_panics() {
        let mut input = connection(&[vec![0x80 | 70]]); // index past both tables
        assert!(matches!(run(&input, 1), Err(Malformed::Hpack { stream: 1, .. })));
        input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, 0, 1, &[0x83]));
        input.extend(frame(0x0, 0, 1, &[]));
        assert_eq!(
            run(&input, 1),
            Err(Malformed::ExpectedContinuation {
                kind: 0,
                stream: 1,
                open: 1
            })
        );
        input = PREFACE.to_vec();
        input.extend(&[0x7f, 0xff, 0xff, TYPE_HEADERS, 0, 0, 0, 0, 1]); // 8 MiB HEADERS
        assert_eq!(run(&input, 1), Err(Malformed::TooLarge { stream: 1 }));

        // Pseudo-random frames after the preface never panic (a small, fixed-seed fuzz).
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for round in 0..2_000 {
            let mut input = PREFACE.to_vec();
            for _ in 0..(round % 40 + 1) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let kind = [TYPE_HEADERS, TYPE_CONTINUATION, 0x0, 0x4][(x % 4) as usize];
                let len = (x >> 8) as usize % 24;
                let payload: Vec<u8> = (0..len).map(|i| (x >> (i % 56)) as u8).collect();
                input.extend(frame(kind, (x >> 16) as u8, (x >> 24) as u32 & 3, &payload));
            }
            let _ = run(&input, 1 + round % 13);
        }
    }

    #[test]
    fn a_set_authority_replaces_any_and_is_indexed_after_the_first_request() {
        // What an h2 client sends: localhost, the same call from its dynamic table, another host.
        let second = vec![0x83, 0x86, 0x80 | 64, 0x80 | 63, 0x80 | 62];
        let input = connection(&[request_block(b"localhost"), second, request_block(b"example.com")]);
        let replace = |authority: &[u8]| Rule::Replace {
            authority: authority.to_vec(),
            in_table: false,
        };
        let out = run_with(replace(SOCKET_PATH), &input, 1).unwrap();
        assert_eq!(out, run_with(replace(SOCKET_PATH), &input, input.len()).unwrap());
        let blocks: Vec<_> = frames(&out).into_iter().skip(1).map(|f| f.3).collect();
        // Like grpc-go: added to the table by the first request, referred to by index after.
        let first = indexed_name(1, SOCKET_PATH);
        assert!(blocks[0].windows(first.len()).any(|w| w == first));
        assert!(blocks[1..].iter().all(|b| b.contains(&(0x80 | 62))));
        // A decoder that follows the table reads the path every time (which h2 rejects)...
        let mut decoder = Decoder::new();
        for block in &blocks {
            let headers = decoder.decode(block).expect("decodes with the client's table");
            let authorities: Vec<_> = headers.iter().filter(|(n, _)| n == b":authority").collect();
            assert_eq!(authorities, [&(b":authority".to_vec(), SOCKET_PATH.to_vec())]);
        }
        assert!(http::uri::Authority::try_from(SOCKET_PATH).is_err());
        // ...and the server's adapter turns it back into localhost.
        for frame in frames(&run(&out, 3).unwrap()).iter().skip(1) {
            assert_eq!(authority(&decode_alone(&frame.3)), "localhost");
        }

        // An authority too large for the table is a literal every time.
        let huge = vec![b'a'; H2_HEADER_TABLE_SIZE];
        let input = connection(&[request_block(b"localhost"), request_block(b"x")]);
        let out = run_with(replace(&huge), &input, 7).unwrap();
        for frame in frames(&out).iter().skip(1) {
            assert_eq!(authority(&decode_alone(&frame.3)).as_bytes(), huge);
        }
    }

    #[test]
    fn an_hpack_bomb_is_bounded() {
        // One 4000-byte entry, then a block indexing it 400 times: 1.6 MB decoded from 400 bytes.
        let mut first = request_block(SOCKET_PATH);
        first.extend([0x40]);
        first.extend(string(b"x"));
        first.extend(string(&[b'y'; 4000]));
        let bomb = vec![0x80 | 62; 400];
        let input = connection(&[first, bomb]);
        assert_eq!(run(&input, 1000), Err(Malformed::TooLarge { stream: 3 }));
    }
}
