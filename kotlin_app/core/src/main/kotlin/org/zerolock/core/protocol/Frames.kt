package org.zerolock.core.protocol

import java.io.ByteArrayOutputStream
import java.io.InputStream
import java.io.OutputStream
import java.util.zip.CRC32

/** Frame codec of PROTOCOL.md sections 2-4. */
object Frames {
    /** The frame header's version byte: the frame layout did not change in protocol version 2. */
    const val VERSION = 1
    /** The session protocol version (AUTH_REQUEST, HELLO, TXT): 2 = sealed sessions (PROTOCOL.md 6.1). */
    const val PROTOCOL_VERSION = 2
    /** Header flags of a sealed frame; a version-1 peer rejects it (reserved flags). */
    const val SEALED_FLAG = 1
    const val HEADER_SIZE = 16
    const val TRAILER_SIZE = 4
    const val DEFAULT_MAX_FRAME = 256L * 1024 * 1024
    const val PREAUTH_MAX_FRAME = 64L * 1024
    /** The host session's frames after the handshake: 1 MiB FILE_CHUNKs and metadata fit many times (2.1). */
    const val SESSION_MAX_FRAME = 64L * 1024 * 1024
    const val MAX_META_BYTES = 1024 * 1024
    const val MAX_TENSORS = 65535
    const val MAX_NAME_BYTES = 1024
    val MAGIC = byteArrayOf(0x5A, 0x4C, 0x57, 0x50) // "ZLWP"

    fun crc32(b: ByteArray, off: Int = 0, len: Int = b.size - off): Long =
        CRC32().also { it.update(b, off, len) }.value

    internal fun u16(b: ByteArray, o: Int): Int = (b[o].toInt() and 0xff) or ((b[o + 1].toInt() and 0xff) shl 8)
    internal fun u32(b: ByteArray, o: Int): Long = (u16(b, o).toLong()) or (u16(b, o + 2).toLong() shl 16)

    private fun ByteArrayOutputStream.u8(v: Int) = write(v and 0xff)
    private fun ByteArrayOutputStream.u16(v: Int) { write(v and 0xff); write((v ushr 8) and 0xff) }
    private fun ByteArrayOutputStream.u32(v: Long) { for (k in 0 until 4) write(((v ushr (8 * k)) and 0xff).toInt()) }

    /** Parsed, checked frame header (steps 2-7 of 2.2). */
    class Header(val type: MsgType, val bodyLen: Long)

    /** Checks 2..7 of PROTOCOL.md 2.2 on the 16 header bytes. */
    fun parseHeader(h: ByteArray, maxFrame: Long, sealed: Boolean = false): Header {
        require(h.size >= HEADER_SIZE)
        for (k in 0 until 4) if (h[k] != MAGIC[k]) throw ProtocolException(ErrorCode.BAD_MAGIC, "not a ZeroLock peer (magic is not ZLWP); check the address and port")
        val version = h[4].toInt() and 0xff
        if (version != VERSION) throw ProtocolException(ErrorCode.BAD_VERSION, "protocol version $version is not supported (this side speaks $VERSION); update the older side")
        if (u32(h, 12) != crc32(h, 0, 12)) throw ProtocolException(ErrorCode.BAD_CHECKSUM, "frame header CRC mismatch; the link corrupts data or lost sync")
        val wantFlags = if (sealed) SEALED_FLAG else 0
        if (u16(h, 6) != wantFlags) malformed("frame flags are ${u16(h, 6)} on a${if (sealed) " sealed" else "n unsealed"} connection, must be $wantFlags (both sides must speak protocol version $PROTOCOL_VERSION)")
        val bodyLen = u32(h, 8)
        if (bodyLen + HEADER_SIZE + TRAILER_SIZE > maxFrame) {
            throw ProtocolException(ErrorCode.OVERSIZED, "frame of ${human(bodyLen + 20)} exceeds the ${human(maxFrame)} limit; send smaller chunks or raise max_frame on the receiver")
        }
        val code = h[5].toInt() and 0xff
        val type = MsgType.fromCode(code) ?: throw ProtocolException(ErrorCode.UNKNOWN_TYPE, "message type 0x%02x is unknown in protocol version 1; update this side".format(code))
        return Header(type, bodyLen)
    }

    private fun human(n: Long): String = when {
        n >= 1L shl 30 -> "%.1f GiB".format(n / (1024.0 * 1024 * 1024))
        n >= 1L shl 20 -> "%.1f MiB".format(n / (1024.0 * 1024))
        n >= 1L shl 10 -> "%.1f KiB".format(n / 1024.0)
        else -> "$n bytes"
    }

    /** Encode [m] as one frame (validates the schema first). */
    fun encode(m: Message): ByteArray = encode(m, null)

    /** One frame; with [seal], sealed (PROTOCOL.md 6.1): the body encrypted, the header as AAD. */
    fun encode(m: Message, seal: Seal?): ByteArray {
        Schema.validate(m)
        val plain = encodeBody(m)
        val bodyLen = plain.size + (if (seal != null) Sealing.TAG_BYTES else 0)
        val header = ByteArrayOutputStream(HEADER_SIZE)
        header.write(MAGIC)
        header.u8(VERSION)
        header.u8(m.type.code)
        header.u16(if (seal != null) SEALED_FLAG else 0)
        header.u32(bodyLen.toLong())
        val h12 = header.toByteArray()
        header.u32(crc32(h12))
        val head = header.toByteArray()
        val body = seal?.seal(head, plain) ?: plain
        val out = ByteArrayOutputStream(HEADER_SIZE + body.size + TRAILER_SIZE)
        out.write(head)
        out.write(body)
        out.u32(crc32(body))
        return out.toByteArray()
    }

    /** Step 10 alone, for a sealed frame's opened body (its CRC covered the sealed bytes). */
    fun decodePlainBody(type: MsgType, body: ByteArray): Message {
        val m = decodeBody(type, body)
        Schema.validate(m)
        return m
    }

    private fun encodeBody(m: Message): ByteArray {
        val meta = MetaJson.encode(m.meta)
        require(meta.size in 1..MAX_META_BYTES) { "metadata of ${meta.size} bytes exceeds $MAX_META_BYTES" }
        require(m.tensors.size <= MAX_TENSORS) { "too many tensors" }
        val b = ByteArrayOutputStream(meta.size + 64 + m.tensors.values.sumOf { it.data.size + 64 })
        b.u32(meta.size.toLong())
        b.write(meta)
        b.u16(m.tensors.size)
        for ((name, t) in m.tensors) {
            val nb = name.toByteArray(Charsets.UTF_8)
            require(nb.size in 1..MAX_NAME_BYTES) { "tensor name must be 1..$MAX_NAME_BYTES bytes" }
            b.u16(nb.size)
            b.write(nb)
            b.u8(t.dtype.code)
            b.u8(t.shape.size)
            for (d in t.shape) b.u32(d)
            b.u32(t.data.size.toLong())
            b.u32(crc32(t.data))
            while (b.size() % 8 != 0) b.write(0)
            b.write(t.data)
        }
        return b.toByteArray()
    }

    /** Decode [buf] as exactly one frame (the test-vector rule: trailing bytes -> MALFORMED). */
    fun decodeOne(buf: ByteArray, maxFrame: Long = DEFAULT_MAX_FRAME): Message {
        if (buf.size < HEADER_SIZE) throw ProtocolException(ErrorCode.TRUNCATED, "buffer of ${buf.size} bytes ends inside the frame header")
        val h = parseHeader(buf, maxFrame)
        val total = HEADER_SIZE + h.bodyLen + TRAILER_SIZE
        if (buf.size < total) throw ProtocolException(ErrorCode.TRUNCATED, "buffer of ${buf.size} bytes ends inside a $total-byte frame")
        val body = buf.copyOfRange(HEADER_SIZE, HEADER_SIZE + h.bodyLen.toInt())
        val m = decodeBodyChecked(h, body, u32(buf, HEADER_SIZE + h.bodyLen.toInt()))
        if (buf.size > total) malformed("${buf.size - total} bytes after the frame")
        return m
    }

    /** Steps 9-10: body CRC, body structure, tensors, schema. */
    fun decodeBodyChecked(h: Header, body: ByteArray, bodyCrc: Long): Message {
        if (crc32(body) != bodyCrc) throw ProtocolException(ErrorCode.BAD_CHECKSUM, "frame body CRC mismatch; the link corrupts data")
        val m = decodeBody(h.type, body)
        Schema.validate(m)
        return m
    }

    private fun decodeBody(type: MsgType, body: ByteArray): Message {
        val n = body.size
        if (n < 4) malformed("body of $n bytes has no room for meta_len")
        val metaLen = u32(body, 0)
        if (metaLen == 0L || metaLen > MAX_META_BYTES) malformed("meta_len $metaLen must be in 1..$MAX_META_BYTES")
        if (4 + metaLen + 2 > n) malformed("meta_len $metaLen runs past the $n-byte body")
        val meta = MetaJson.parseObject(body, 4, metaLen.toInt())
        var o = 4 + metaLen.toInt()
        val count = u16(body, o)
        o += 2
        val tensors = LinkedHashMap<String, Tensor>()
        repeat(count) { idx ->
            fun need(k: Long, what: String) { if (o + k > n) malformed("tensor record ${idx + 1}/$count: $what runs past the end of the body") }
            need(2, "name length")
            val nameLen = u16(body, o); o += 2
            if (nameLen !in 1..MAX_NAME_BYTES) malformed("tensor name length $nameLen must be 1..$MAX_NAME_BYTES")
            need(nameLen.toLong(), "name")
            val name = try {
                Charsets.UTF_8.newDecoder().decode(java.nio.ByteBuffer.wrap(body, o, nameLen)).toString()
            } catch (e: java.nio.charset.CharacterCodingException) { malformed("tensor name is not UTF-8") }
            o += nameLen
            if (name in tensors) malformed("duplicate tensor name ${Quote.quote(name)}")
            need(2, "dtype/ndim")
            val dtypeCode = body[o].toInt() and 0xff
            val dtype = DType.fromCode(dtypeCode) ?: malformed("tensor ${Quote.quote(name)}: unknown dtype code $dtypeCode")
            val ndim = body[o + 1].toInt() and 0xff
            o += 2
            if (ndim > Tensor.MAX_DIMS) malformed("tensor ${Quote.quote(name)}: ndim $ndim > ${Tensor.MAX_DIMS}")
            need(4L * ndim + 8, "shape")
            val shape = LongArray(ndim) { u32(body, o + 4 * it) }
            o += 4 * ndim
            val count = Tensor.elementCountOrNull(shape) ?: malformed("tensor ${Quote.quote(name)}: product of dims ${shape.toList()} is >= 2^32")
            val nbytes = u32(body, o)
            val dataCrc = u32(body, o + 4)
            o += 8
            if (nbytes != count * dtype.itemSize) malformed("tensor ${Quote.quote(name)}: nbytes $nbytes != ${count} elements * ${dtype.itemSize}")
            val pad = (8 - o % 8) % 8
            if (o + pad + nbytes > n) malformed("tensor ${Quote.quote(name)}: ${nbytes} data bytes run past the end of the body")
            for (k in 0 until pad) if (body[o + k] != 0.toByte()) malformed("tensor ${Quote.quote(name)}: non-zero padding")
            o += pad
            val data = body.copyOfRange(o, o + nbytes.toInt())
            o += nbytes.toInt()
            if (crc32(data) != dataCrc) throw ProtocolException(ErrorCode.BAD_CHECKSUM, "tensor ${Quote.quote(name)} data CRC mismatch; the sender computed it wrong")
            if (dtype == DType.BOOL && data.any { it != 0.toByte() && it != 1.toByte() }) malformed("tensor ${Quote.quote(name)}: bool bytes must be 0 or 1")
            tensors[name] = Tensor(dtype, shape, data)
        }
        if (o != n) malformed("${n - o} bytes left after the last tensor record")
        return Message(type, meta, tensors)
    }
}

/** Reads frames from a stream (one connection); [maxFrame] can be raised after the handshake. */
class FrameReader(private val input: InputStream, var maxFrame: Long = Frames.PREAUTH_MAX_FRAME) {
    /** Set by the handshake once it is done: every later frame must open with it (PROTOCOL.md 6.1). */
    @Volatile var seal: Seal? = null

    /** Reads into [buf] from [off] until [len] bytes or the end of the stream. A socket timeout
     *  (soTimeout) before the frame's first byte propagates as is (a quiet peer between frames);
     *  after it, the frame stalled: TIMEOUT, the stream is unusable (PROTOCOL.md 6). */
    private fun readFully(buf: ByteArray, off: Int, len: Int, frameStarted: Boolean, what: String): Int {
        var got = 0
        while (got < len) {
            val r = try {
                input.read(buf, off + got, len - got)
            } catch (e: java.net.SocketTimeoutException) {
                if (!frameStarted && got == 0) throw e
                throw ProtocolException(ErrorCode.TIMEOUT, "peer stalled mid-frame ($what); the connection is unusable, reconnect")
            }
            if (r < 0) break
            got += r
        }
        return got
    }

    /** Next message; [ConnectionClosedException] on a clean end of stream between frames. The
     *  body's buffer grows as its bytes arrive (doubling from 64 KiB): a header that declares a
     *  large body and then sends nothing costs 64 KiB, not the declared size (PROTOCOL.md 2.1). */
    fun read(): Message {
        val h = ByteArray(Frames.HEADER_SIZE)
        val got = readFully(h, 0, h.size, false, "header")
        if (got == 0) throw ConnectionClosedException()
        if (got < h.size) throw ProtocolException(ErrorCode.TRUNCATED, "stream ended inside a frame header ($got of 16 bytes)")
        val seal = this.seal
        val header = Frames.parseHeader(h, maxFrame, sealed = seal != null)
        val need = (header.bodyLen + Frames.TRAILER_SIZE).toInt()
        var rest = ByteArray(minOf(need, FIRST_BODY_BUF))
        var have = 0
        while (true) {
            val n = readFully(rest, have, rest.size - have, true, "${header.type} body, $have of $need bytes")
            have += n
            if (have < rest.size) throw ProtocolException(ErrorCode.TRUNCATED, "stream ended inside a frame body ($have of $need bytes)")
            if (have == need) break
            rest = rest.copyOf(minOf(need.toLong(), 2L * rest.size).toInt())
        }
        val body = rest.copyOfRange(0, header.bodyLen.toInt())
        if (seal == null) return Frames.decodeBodyChecked(header, body, Frames.u32(rest, header.bodyLen.toInt()))
        if (Frames.crc32(body) != Frames.u32(rest, header.bodyLen.toInt())) throw ProtocolException(ErrorCode.BAD_CHECKSUM, "frame body CRC mismatch; the link corrupts data")
        if (body.size < Sealing.TAG_BYTES) throw ProtocolException(ErrorCode.MALFORMED, "sealed ${header.type} body of ${body.size} bytes is shorter than its tag")
        // opened before any byte of the body is parsed: a frame that fails here is never acted on
        return Frames.decodePlainBody(header.type, seal.open(h, body, header.type.name))
    }

    companion object {
        const val FIRST_BODY_BUF = 64 * 1024
    }
}

/** Writes frames to a stream; thread-safe (one frame at a time). */
class FrameWriter(private val output: OutputStream, private val limiter: RateLimiter? = null) {
    /** Set by the handshake once it is done: every later frame goes out sealed (PROTOCOL.md 6.1). */
    @Volatile var seal: Seal? = null

    /** Sends [m] as one frame; returns its size in bytes (what the link counts as sent). */
    @Synchronized
    fun write(m: Message): Int {
        val frame = Frames.encode(m, seal)
        if (limiter == null) {
            output.write(frame)
        } else { // paced: RateLimiter.PIECE bytes at a time, each flushed once the bucket allows it (zl_mobile's _send)
            var off = 0
            while (off < frame.size) {
                val n = minOf(RateLimiter.PIECE, frame.size - off)
                limiter.consume(n)
                output.write(frame, off, n)
                output.flush()
                off += n
            }
        }
        output.flush()
        return frame.size
    }
}

