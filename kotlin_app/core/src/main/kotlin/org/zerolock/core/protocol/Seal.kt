package org.zerolock.core.protocol

import java.security.KeyFactory
import java.security.KeyPairGenerator
import java.security.PrivateKey
import java.security.spec.PKCS8EncodedKeySpec
import java.security.spec.X509EncodedKeySpec
import javax.crypto.AEADBadTagException
import javax.crypto.Cipher
import javax.crypto.KeyAgreement
import javax.crypto.spec.GCMParameterSpec
import javax.crypto.spec.SecretKeySpec

/**
 * Record layer of protocol version 2 (PROTOCOL.md 6.1): X25519 shares in the handshake, HKDF-SHA256
 * keys per direction, AES-256-GCM per frame with a 64-bit counter nonce and the frame header as
 * associated data. Only the JDK's javax.crypto primitives (Android has the same); HKDF is the RFC
 * 5869 construction over HmacSHA256, not a cipher.
 */
object Sealing {
    const val TAG_BYTES = 16
    const val SHARE_BYTES = 32
    const val BENCH_ENV = "ZL_BENCHMARK_ONLY_UNSEALED"
    private val INFO_H2D = "ZLWP2 seal host->device".toByteArray(Charsets.US_ASCII) + byteArrayOf(0)
    private val INFO_D2H = "ZLWP2 seal device->host".toByteArray(Charsets.US_ASCII) + byteArrayOf(0)
    // DER prefixes of RFC 8410: the JDK takes X25519 keys only in these wrappings
    private val X509_PREFIX = Handshake.unhex("302a300506032b656e032100")
    private val PKCS8_PREFIX = Handshake.unhex("302e020100300506032b656e04220420")

    /** bench/sealing.py's switch (both ends): never set it outside a throughput comparison. */
    fun disabledForBenchmark(): Boolean = System.getenv(BENCH_ENV) == "1"

    class Share(val private: PrivateKey, val public: ByteArray)

    fun newShare(): Share {
        val kp = KeyPairGenerator.getInstance("X25519").generateKeyPair()
        val enc = kp.public.encoded
        return Share(kp.private, enc.copyOfRange(enc.size - SHARE_BYTES, enc.size))
    }

    fun privateFromRaw(raw: ByteArray): PrivateKey =
        KeyFactory.getInstance("X25519").generatePrivate(PKCS8EncodedKeySpec(PKCS8_PREFIX + raw))

    fun sharedSecret(priv: PrivateKey, peerShare: ByteArray): ByteArray {
        if (peerShare.size != SHARE_BYTES) throw ProtocolException(ErrorCode.UNAUTHENTICATED, "key share must be 32 bytes")
        val s = try {
            val pub = KeyFactory.getInstance("X25519").generatePublic(X509EncodedKeySpec(X509_PREFIX + peerShare))
            KeyAgreement.getInstance("X25519").run { init(priv); doPhase(pub, true); generateSecret() }
        } catch (e: java.security.GeneralSecurityException) {
            throw ProtocolException(ErrorCode.UNAUTHENTICATED, "peer's key share refused (${e.message}); a low-order point gives no secret")
        }
        if (s.all { it.toInt() == 0 }) throw ProtocolException(ErrorCode.UNAUTHENTICATED, "peer's key share is a low-order point; refused")
        return s
    }

    /** RFC 5869 with SHA-256, one 32-byte block: T(1) = HMAC(PRK, info || 0x01). */
    fun hkdf32(salt: ByteArray, ikm: ByteArray, info: ByteArray): ByteArray =
        Handshake.hmac(Handshake.hmac(salt, ikm), info + byteArrayOf(1))

    /** (host->device key, device->host key): salt Nh||Nd, IKM token||DH, info label||Ph||Pd. */
    fun deriveKeys(token: ByteArray, nh: ByteArray, nd: ByteArray, dh: ByteArray, ph: ByteArray, pd: ByteArray): Pair<ByteArray, ByteArray> =
        hkdf32(nh + nd, token + dh, INFO_H2D + ph + pd) to hkdf32(nh + nd, token + dh, INFO_D2H + ph + pd)

    /** 12-byte GCM nonce: 4 zero bytes, then the counter as u64 little-endian. */
    fun nonce(counter: Long): ByteArray = ByteArray(12).also { for (k in 0 until 8) it[4 + k] = (counter ushr (8 * k)).toByte() }
}

/** One connection's two directions; the writer and the reader each hold it (sends are serialised
 *  by FrameWriter, reads by the one reader), so counter order is wire order. */
class Seal(sendKey: ByteArray, recvKey: ByteArray, sent: Long = 0, received: Long = 0) {
    private val sendKey = SecretKeySpec(sendKey, "AES")
    private val recvKey = SecretKeySpec(recvKey, "AES")
    private val enc = Cipher.getInstance("AES/GCM/NoPadding")
    private val dec = Cipher.getInstance("AES/GCM/NoPadding")
    var sent = sent; private set          // counter of the next frame sent (a start other than 0: test vectors)
    var received = received; private set  // counter of the next frame expected

    @Synchronized fun seal(header: ByteArray, body: ByteArray): ByteArray {
        if (sent == -1L) throw ProtocolException(ErrorCode.INTERNAL, "2^64 frames sent on one connection; reconnect")
        enc.init(Cipher.ENCRYPT_MODE, sendKey, GCMParameterSpec(128, Sealing.nonce(sent++)))
        enc.updateAAD(header)
        return enc.doFinal(body)
    }

    @Synchronized fun open(header: ByteArray, sealed: ByteArray, what: String): ByteArray {
        dec.init(Cipher.DECRYPT_MODE, recvKey, GCMParameterSpec(128, Sealing.nonce(received)))
        dec.updateAAD(header)
        val plain = try { dec.doFinal(sealed) } catch (e: AEADBadTagException) {
            throw ProtocolException(ErrorCode.UNAUTHENTICATED, "sealed $what frame #$received failed to open (altered, replayed, dropped or reordered in transit, or a different key); nothing in it was used, the connection ends")
        }
        received++
        return plain
    }
}
