package org.zerolock.core

import java.util.TreeMap

/**
 * The link rules of docs/PROTOCOL.md 5.4.1 as plain state machines, no sockets: the same rules as the
 * Python reference (zl_mobile/link_rules.py), with the same names:
 *
 * - [OutboundLinkState] is the upstream side of a stage-to-stage link (and of the host's feed into
 *   stage 0): the replay buffer of hidden states this stage produced, the downstream's resume point
 *   and the credits. The networked `device.OutboundLink` drives it.
 * - [InboundQueue] is the downstream side: hidden states received, by micro-batch id; with
 *   [InboundQueue.nextAfter] it gives the resume point announced in REPLAY_REQUEST, and
 *   [initialCredit] the first CREDIT; [InboundCredits] counts the frames one upstream connection may
 *   still send. The networked `device.InboundLink` (device/TcpLinks.kt) drives them.
 *
 * tests/vectors/link_rules/link_rules.json holds scenarios that both implementations run on these
 * pure classes (tests/test_link_rules_vectors.py for Python, LinkRulesVectorsTest for Kotlin); the
 * TCP layer has its loopback tests apart (TcpLinksTest, tests/test_links_tcp.py).
 */
object LinkRules {
    /** "To the end" in REPLAY_REQUEST (2^53: the largest integer every JSON reader keeps exact). */
    const val NO_END: Long = 1L shl 53
    /** PROTOCOL.md 6: a frame begun on a link with no byte for this long is a stall (TIMEOUT). */
    const val STALL_MS: Int = 10_000
    /** PROTOCOL.md 6: a stage's data port holds at most this many connections at once, authenticated
     *  or not (zl_mobile.link_rules.LINK_MAX_CONNECTIONS, the host port's default too). */
    const val MAX_CONNECTIONS: Int = 64

    /** Python's message (zl_mobile.link_rules.replay_unavailable_message), word for word: the host shows it. */
    fun replayUnavailableMessage(from: Long, to: Long, linkName: String, heldFrom: Long): String =
        "replay unavailable: micro-batches $from-$to needed downstream of $linkName are no longer held " +
            "(it holds $heldFrom onward); the downstream asked below what it had reported committed, " +
            "so its checkpoint or the upstream's replay files were lost: restore that stage's work dir " +
            "or start a new run"

    /** Python's message (zl_mobile.link_rules.commit_beyond_sent_message), word for word: the last
     *  micro-batch of [window] is written exactly (Python's integers do not wrap), even past 2^63. */
    fun commitBeyondSentMessage(window: Long, windowSize: Int, usableBelow: Long, linkName: String): String =
        "CHECKPOINT_COMMITTED window $window covers micro-batches up to " +
            "${java.math.BigInteger.valueOf(window).add(java.math.BigInteger.ONE).multiply(java.math.BigInteger.valueOf(windowSize.toLong())).subtract(java.math.BigInteger.ONE)}, " +
            "but $linkName has sent " +
            "only those below $usableBelow on this link: a downstream cannot commit what it never received; " +
            "nothing was pruned (fix the downstream's commit bookkeeping)"

    /** Python's message (zl_mobile.link_rules.hidden_state_without_credit_message), word for word. */
    fun noCreditMessage(mb: Long, linkName: String): String =
        "HIDDEN_STATE for micro-batch $mb on $linkName with no credit left: an upstream sends one frame per " +
            "credit granted (PROTOCOL.md 5.4.1); it was not kept"

    /** The refusal of a HIDDEN_STATE the stage cannot use ([why]: [unusable]); Python's
     *  zl_mobile.link_rules.unusable_message, word for word. */
    fun unusableMessage(mb: Long, linkName: String, why: String): String = "HIDDEN_STATE for micro-batch $mb on $linkName: $why; it was not kept"

    /** The first micro-batch after [window]: `(window + 1) * windowSize`, saturated at Long.MAX_VALUE
     *  (PROTOCOL.md 5.4: a peer may send any window up to 2^63-1; a wrapped end would pass every check). */
    fun windowEnd(window: Long, windowSize: Int): Long =
        if (window > Long.MAX_VALUE / windowSize - 1) Long.MAX_VALUE else (window + 1) * windowSize

    /** Credits added without wrapping: a downstream may grant up to 2^63-1 at a time (PROTOCOL.md 5.4). */
    fun addCredits(credits: Long, n: Long): Long = if (n > Long.MAX_VALUE - credits) Long.MAX_VALUE else credits + n

    /** The largest frame a stage link needs (PROTOCOL.md 2.1), as zl_mobile.link_rules.link_frame_limit:
     *  [dataElements] elements of at most 8 bytes, twice over for what travels with them, a full
     *  metadata part and the records' headers. */
    fun linkFrameLimit(dataElements: Long): Long =
        minOf(256L shl 20, 2 * 8 * dataElements + (1L shl 20) + (64L shl 10))

    /** Why a stage whose next micro-batch is [next] can never use micro-batch [mb] labelled
     *  [window] (null: it can), as zl_mobile.link_rules.unusable_reason. */
    fun unusable(mb: Long, window: Long, next: Long, inflightDepth: Int, windowSize: Int, total: Long?): String? = when {
        mb < next -> "this stage is past it (it needs $next next)"
        mb >= next + 2L * inflightDepth -> "beyond what the $inflightDepth credits allow from micro-batch $next, the next this stage needs"
        total != null && mb >= total -> "the run has $total micro-batches"
        window != mb / windowSize -> "labelled window $window, but window size $windowSize puts it in window ${mb / windowSize}"
        else -> null
    }

    /** The CREDIT a downstream grants right after REPLAY_REQUEST: inflight_depth - queued, or none if <= 0. */
    fun initialCredit(inflightDepth: Int, queued: Int): Long? = (inflightDepth - queued).toLong().takeIf { it > 0 }
}

/**
 * Upstream side of one link. Not thread-safe by itself: the owner serializes calls.
 *
 * - [publish]: every hidden state produced goes into the replay buffer (ordered by micro-batch).
 *   Nothing is dropped before the downstream commits it: when [full] (the buffer holds
 *   [replayHorizon] entries) the producer waits before its next forward (backpressure).
 * - [connected]: a new connection starts with no resume point and zero credits.
 * - [onReplayRequest]: the downstream says which micro-batch it needs next; sending resumes
 *   there. Asking below [prunedBelow] is an error (the text of [LinkRules.replayUnavailableMessage]),
 *   returned, never skipped silently; sending then resumes at [prunedBelow].
 * - [onCredit]: adds to the allowance; every frame sent spends one ([takeNext]).
 * - [onCommitted]: the downstream durably used every micro-batch of windows <= w, so they are
 *   dropped (when [pruneOnCommit]; the host's feed keeps its inputs for global rollback) and a later
 *   request below (w+1)*W is an error.
 */
class OutboundLinkState<T>(
    val name: String,
    val windowSize: Int,
    val replayHorizon: Int,
    val pruneOnCommit: Boolean = true,
) {
    init {
        require(windowSize >= 1) { "window size must be >= 1" }
        require(replayHorizon >= 1) { "replay horizon must be >= 1" }
    }

    private val buffer = TreeMap<Long, T>()

    /** Every micro-batch below this was dropped from the buffer. */
    var prunedBelow: Long = 0
        private set
    /** The next micro-batch the downstream wants; null while not connected or before REPLAY_REQUEST. */
    var next: Long? = null
        private set
    /** Frames the downstream still allows on this connection. */
    var credits: Long = 0
        private set
    /** The downstream's last CHECKPOINT_COMMITTED window (-1: none yet). */
    var downstreamCommitted: Long = -1
        private set
    /** What the downstream can have used on this connection: below its REPLAY_REQUEST's start, or
     *  sent on it (null: nothing yet). A CHECKPOINT_COMMITTED past it is a lie. */
    var usableBelow: Long? = null
        private set

    fun buffered(): List<Long> = buffer.keys.toList()
    operator fun contains(mb: Long): Boolean = buffer.containsKey(mb)

    fun publish(mb: Long, entry: T) {
        require(mb >= 0) { "micro-batch id must be >= 0" }
        buffer[mb] = entry
    }

    /**
     * A restarted stage's buffer from the on-disk copy ([entries]: an unbroken run of micro-batches
     * ending below [firstMb], its resume point); nothing older is held, so a request below them is
     * the replay-unavailable error, not a wait.
     */
    fun restore(entries: List<Pair<Long, T>>, firstMb: Long) {
        for ((mb, e) in entries) buffer[mb] = e
        prunedBelow = if (buffer.isEmpty()) firstMb else buffer.firstKey()
    }

    /** The buffer holds its bound: the producer must wait for a commit before its next forward. */
    fun full(): Boolean = buffer.size >= replayHorizon

    fun connected() { next = null; credits = 0; usableBelow = null }
    fun disconnected() { next = null }

    /** REPLAY_REQUEST from the downstream. Returns the replay-unavailable error text, or null. */
    fun onReplayRequest(from: Long): String? {
        var start = from
        var error: String? = null
        if (start < prunedBelow) {
            error = LinkRules.replayUnavailableMessage(start, prunedBelow - 1, name,
                if (buffer.isEmpty()) prunedBelow else buffer.firstKey())
            start = prunedBelow
        }
        next = start
        usableBelow = maxOf(usableBelow ?: 0, start)
        return error
    }

    fun onCredit(n: Long) {
        require(n >= 1) { "credits must be >= 1" }
        credits = LinkRules.addCredits(credits, n)
    }

    /** CHECKPOINT_COMMITTED: prunes, or returns the error text (nothing pruned) when the window
     *  ends past what the downstream can have received on this connection ([usableBelow]). With
     *  [checkSent] false (the host's feed, which holds nothing) it is never refused. */
    fun onCommitted(window: Long, checkSent: Boolean = pruneOnCommit): String? {
        val end = LinkRules.windowEnd(window, windowSize)
        if (checkSent && end > (usableBelow ?: 0)) return LinkRules.commitBeyondSentMessage(window, windowSize, usableBelow ?: 0, name)
        downstreamCommitted = maxOf(downstreamCommitted, window)
        if (!pruneOnCommit) return null
        buffer.headMap(end, false).clear()
        prunedBelow = maxOf(prunedBelow, end)
        return null
    }

    fun sendable(): Boolean { val n = next; return n != null && credits > 0 && buffer.containsKey(n) }

    /** The next frame to send, spending one credit; null if the rules allow none now. */
    fun takeNext(): Pair<Long, T>? {
        if (!sendable()) return null
        val mb = next!!
        credits -= 1
        next = mb + 1
        usableBelow = maxOf(usableBelow ?: 0, mb + 1)
        return mb to buffer.getValue(mb)
    }
}

/**
 * Downstream side: the HIDDEN_STATE frames one upstream connection may still send (PROTOCOL.md
 * 5.4.1: the downstream enforces its credits). A new connection starts with none. Not thread-safe
 * by itself: the owner serializes calls.
 */
class InboundCredits(val name: String) {
    var credits: Long = 0
        private set

    /** Counted before the CREDIT goes out: the frame it allows may come back at once. */
    fun grant(n: Long) { credits = LinkRules.addCredits(credits, n) }

    /** HIDDEN_STATE [mb] arrived: spends a credit, or returns the refusal (the frame is not kept). */
    fun spend(mb: Long): String? {
        if (credits <= 0) return LinkRules.noCreditMessage(mb, name)
        credits -= 1
        return null
    }
}

/**
 * Downstream side: hidden states received, by micro-batch id. Thread-safe (the link's reader
 * thread puts, the stage's thread takes). Entries are taken in order, so with [dropOlder] the
 * ids below the one taken are stale duplicates and are dropped (gradients of BP baselines are
 * taken in reverse order and must all stay: dropOlder = false).
 */
class InboundQueue<T>(val dropOlder: Boolean = true) {
    private val items = TreeMap<Long, T>()
    private val lock = Object()
    private var stopped = false

    fun put(mb: Long, entry: T) = synchronized(lock) { items[mb] = entry; lock.notifyAll() }

    /** Micro-batch [mb] if queued (and the older ones dropped), else null; never waits. */
    fun tryTake(mb: Long): T? = synchronized(lock) { takeLocked(mb) }

    /** Wait up to [timeoutMs] for micro-batch [mb]; null on timeout or after [stop]. */
    fun take(mb: Long, timeoutMs: Long): T? = synchronized(lock) {
        val deadline = System.nanoTime() + timeoutMs * 1_000_000
        while (!items.containsKey(mb) && !stopped) {
            val left = (deadline - System.nanoTime()) / 1_000_000
            if (left <= 0) return null
            lock.wait(left)
        }
        takeLocked(mb)
    }

    private fun takeLocked(mb: Long): T? {
        if (!items.containsKey(mb)) return null
        if (dropOlder) items.headMap(mb, false).clear()
        return items.remove(mb)
    }

    val size: Int get() = synchronized(lock) { items.size }
    fun ids(): List<Long> = synchronized(lock) { items.keys.toList() }

    /** The first micro-batch not yet queued, counting from [mb] (the resume point). */
    fun nextAfter(mb: Long): Long = synchronized(lock) { var m = mb; while (items.containsKey(m)) m++; m }

    fun stop() = synchronized(lock) { stopped = true; lock.notifyAll() }
}
