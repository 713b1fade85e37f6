package org.zerolock.core.protocol

import java.security.MessageDigest
import java.security.SecureRandom
import javax.crypto.Mac
import javax.crypto.spec.SecretKeySpec

/** HMAC-SHA256 challenge-response of PROTOCOL.md section 6. */
object Handshake {
    const val NONCE_BYTES = 32
    const val HANDSHAKE_TIMEOUT_MS = 10_000
    private val HOST_LABEL = "ZLWP1 host".toByteArray(Charsets.US_ASCII)
    private val DEVICE_LABEL = "ZLWP1 device".toByteArray(Charsets.US_ASCII)
    private val rng = SecureRandom()

    fun hex(b: ByteArray): String = b.joinToString("") { "%02x".format(it.toInt() and 0xff) }

    fun unhex(s: String): ByteArray {
        require(s.length % 2 == 0 && s.all { it in '0'..'9' || it in 'a'..'f' }) { "not lowercase hex" }
        return ByteArray(s.length / 2) { s.substring(2 * it, 2 * it + 2).toInt(16).toByte() }
    }

    /** A fresh pairing token: 32 random bytes as 64 lowercase hex digits. */
    fun newToken(): String = hex(randomBytes(32))

    /** Token hex -> 32-byte HMAC key. */
    fun parseToken(token: String): ByteArray {
        val t = token.trim().lowercase()
        require(t.length == 64 && t.all { it in '0'..'9' || it in 'a'..'f' }) { "a pairing token is 64 hex digits" }
        return unhex(t)
    }

    fun randomBytes(n: Int = NONCE_BYTES): ByteArray = ByteArray(n).also { rng.nextBytes(it) }

    fun hostInput(hostNonce: ByteArray, deviceNonce: ByteArray): ByteArray = HOST_LABEL + byteArrayOf(0) + hostNonce + deviceNonce
    fun deviceInput(hostNonce: ByteArray, deviceNonce: ByteArray): ByteArray = DEVICE_LABEL + byteArrayOf(0) + hostNonce + deviceNonce

    fun hmac(key: ByteArray, data: ByteArray): ByteArray =
        Mac.getInstance("HmacSHA256").also { it.init(SecretKeySpec(key, "HmacSHA256")) }.doFinal(data)

    fun hostProof(key: ByteArray, hostNonce: ByteArray, deviceNonce: ByteArray): ByteArray = hmac(key, hostInput(hostNonce, deviceNonce))
    fun deviceProof(key: ByteArray, hostNonce: ByteArray, deviceNonce: ByteArray): ByteArray = hmac(key, deviceInput(hostNonce, deviceNonce))

    /** Constant-time comparison. */
    fun proofEquals(a: ByteArray, b: ByteArray): Boolean = MessageDigest.isEqual(a, b)
}

/**
 * Device-side authentication state shared by all connections of one listening endpoint: the
 * key, the single session slot, and the last [nonceMemory] host nonces seen (replay guard).
 */
class DeviceAuth(token: String, val deviceName: String, private val nonceMemory: Int = 4096) {
    private val key = Handshake.parseToken(token)
    private val seen = LinkedHashSet<String>()
    private var sessionHeld = false

    @Synchronized fun sessionBusy(): Boolean = sessionHeld

    /** Atomically take the session slot; false if another session holds it. */
    @Synchronized fun tryTakeSession(): Boolean { if (sessionHeld) return false; sessionHeld = true; return true }
    @Synchronized fun releaseSession() { sessionHeld = false }

    /** Record a host nonce; false if it was seen before (replay). */
    @Synchronized fun rememberNonce(nonceHex: String): Boolean {
        if (nonceHex in seen) return false
        seen.add(nonceHex)
        if (seen.size > nonceMemory) seen.remove(seen.first())
        return true
    }

    internal fun keyBytes(): ByteArray = key
}

/**
 * Runs the device side of the handshake on one connection. On success the session slot is
 * held (release it with [DeviceAuth.releaseSession] when the connection ends) and HELLO has
 * been sent; on failure ERROR has been sent and [ProtocolException] is thrown (caller closes).
 * [takesSlot] = false for stage-to-stage links, which use their own [DeviceAuth].
 */
fun deviceHandshake(reader: FrameReader, writer: FrameWriter, auth: DeviceAuth, hello: Message, takesSlot: Boolean = true) {
    fun fail(code: ErrorCode, msg: String): Nothing {
        val e = ProtocolException(code, msg)
        try { writer.write(e.toMessage()) } catch (_: Exception) {}
        throw e
    }
    fun next(expected: MsgType): Message {
        val m = try { reader.read() } catch (e: ProtocolException) { fail(e.code, e.detail) }
        if (m.type != expected) fail(ErrorCode.UNAUTHENTICATED, "expected ${expected.name} before authentication, got ${m.type.name}; authenticate first")
        return m
    }
    val req = next(MsgType.AUTH_REQUEST)
    if (req.long("protocol_version") != Frames.PROTOCOL_VERSION.toLong()) {
        fail(ErrorCode.BAD_VERSION, "host speaks protocol version ${req.long("protocol_version")}, this device speaks ${Frames.PROTOCOL_VERSION} (sealed sessions); upgrade the older side")
    }
    val ph = (req.meta["host_share"] as? String)?.let { Handshake.unhex(it) }
        ?: fail(ErrorCode.UNAUTHENTICATED, "AUTH_REQUEST of protocol version ${Frames.PROTOCOL_VERSION} without host_share; the host must send its X25519 share")
    if (takesSlot && auth.sessionBusy()) fail(ErrorCode.BUSY, "device already serves another host session; end it first")
    val nhHex = req.string("host_nonce")
    if (!auth.rememberNonce(nhHex)) fail(ErrorCode.UNAUTHENTICATED, "host nonce replayed; start a new handshake with a fresh nonce")
    val nd = Handshake.randomBytes()
    val share = Sealing.newShare()
    writer.write(Message(MsgType.AUTH_CHALLENGE, linkedMapOf("device_nonce" to Handshake.hex(nd), "device_name" to auth.deviceName, "device_share" to Handshake.hex(share.public))))
    val resp = next(MsgType.AUTH_RESPONSE)
    val nh = Handshake.unhex(nhHex)
    val expected = Handshake.hostProof(auth.keyBytes(), nh, nd)
    if (!Handshake.proofEquals(expected, Handshake.unhex(resp.string("host_proof")))) {
        fail(ErrorCode.UNAUTHENTICATED, "wrong host proof; give zl-host the token shown on the device")
    }
    val dh = try { Sealing.sharedSecret(share.private, ph) } catch (e: ProtocolException) { fail(e.code, e.detail) }
    if (takesSlot && !auth.tryTakeSession()) fail(ErrorCode.BUSY, "device already serves another host session; end it first")
    try {
        writer.write(Message(MsgType.AUTH_OK, linkedMapOf("device_proof" to Handshake.hex(Handshake.deviceProof(auth.keyBytes(), nh, nd)))))
        // AUTH_OK went out plain; everything after it is sealed (PROTOCOL.md 6.1), HELLO first
        if (!Sealing.disabledForBenchmark()) {
            val (h2d, d2h) = Sealing.deriveKeys(auth.keyBytes(), nh, nd, dh, ph, share.public)
            val seal = Seal(d2h, h2d)
            writer.seal = seal
            reader.seal = seal
        }
        writer.write(hello)
    } catch (e: Exception) {
        if (takesSlot) auth.releaseSession()
        throw e
    }
}

/**
 * Host side of the handshake (used by a stage that connects to its downstream neighbour, and by
 * tests). Returns the device's HELLO. An ERROR from the device ends it with that code.
 */
fun hostHandshake(reader: FrameReader, writer: FrameWriter, token: String, hostName: String): Message {
    val key = Handshake.parseToken(token)
    val nh = Handshake.randomBytes()
    fun expect(t: MsgType): Message {
        val m = reader.read()
        if (m.type == MsgType.ERROR) throw ProtocolException(ErrorCode.fromWire(m.string("code")), m.string("message"))
        if (m.type != t) throw ProtocolException(ErrorCode.UNEXPECTED, "expected ${t.name}, got ${m.type.name}")
        return m
    }
    val share = Sealing.newShare()
    writer.write(Message(MsgType.AUTH_REQUEST, linkedMapOf("protocol_version" to Frames.PROTOCOL_VERSION.toLong(), "host_nonce" to Handshake.hex(nh), "host_name" to hostName, "host_share" to Handshake.hex(share.public))))
    val ch = expect(MsgType.AUTH_CHALLENGE)
    val nd = Handshake.unhex(ch.string("device_nonce"))
    val pd = (ch.meta["device_share"] as? String)?.let { Handshake.unhex(it) }
        ?: throw ProtocolException(ErrorCode.BAD_VERSION, "device sent no device_share: it speaks protocol version 1 (unsealed), this side ${Frames.PROTOCOL_VERSION} (sealed sessions); upgrade the device")
    if (nd.contentEquals(nh)) throw ProtocolException(ErrorCode.UNAUTHENTICATED, "device nonce equals the host nonce; reflection refused")
    writer.write(Message(MsgType.AUTH_RESPONSE, linkedMapOf("host_proof" to Handshake.hex(Handshake.hostProof(key, nh, nd)))))
    val ok = expect(MsgType.AUTH_OK)
    if (!Handshake.proofEquals(Handshake.deviceProof(key, nh, nd), Handshake.unhex(ok.string("device_proof")))) {
        throw ProtocolException(ErrorCode.UNAUTHENTICATED, "wrong device proof; the device does not hold this token")
    }
    if (!Sealing.disabledForBenchmark()) {
        // HELLO is the first sealed frame: opening it confirms both sides derived the same keys
        val (h2d, d2h) = Sealing.deriveKeys(key, nh, nd, Sealing.sharedSecret(share.private, pd), share.public, pd)
        val seal = Seal(h2d, d2h)
        writer.seal = seal
        reader.seal = seal
    }
    return expect(MsgType.HELLO)
}
