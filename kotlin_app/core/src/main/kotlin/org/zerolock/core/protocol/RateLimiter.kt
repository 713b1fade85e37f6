package org.zerolock.core.protocol

/**
 * Token bucket, as zl_mobile/protocol/transport.py's RateLimiter (zl-phone --rate-mbit):
 * consume(n) blocks until n bytes may go out at [bytesPerS] on average, allowing bursts of up to
 * [burst] bytes (default 1/20 s worth, at least 16 KiB). Thread-safe; one limiter shared by
 * several links shapes their sum. [FrameWriter] feeds it 64 KiB pieces, as zl_mobile's sender.
 */
class RateLimiter(val bytesPerS: Double, burst: Double? = null) {
    init { require(bytesPerS > 0) { "bytes per second must be > 0, got $bytesPerS" } }
    private val burst = burst ?: maxOf(16.0 * 1024, bytesPerS / 20)
    private var tokens = this.burst
    private var last = System.nanoTime()

    fun consume(n: Int) {
        val waitS = synchronized(this) {
            val now = System.nanoTime()
            tokens = minOf(burst, tokens + (now - last) / 1e9 * bytesPerS)
            last = now
            tokens -= n // may go negative: the debt is paid by sleeping
            if (tokens < 0) -tokens / bytesPerS else 0.0
        }
        if (waitS > 0) Thread.sleep((waitS * 1000).toLong(), ((waitS * 1e9) % 1_000_000).toInt())
    }

    companion object {
        /** zl_mobile's piece size: a frame goes out in these, each after consume(its size). */
        const val PIECE = 64 * 1024
    }
}
