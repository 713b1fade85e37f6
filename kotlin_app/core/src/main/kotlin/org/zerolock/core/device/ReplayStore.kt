package org.zerolock.core.device

import org.zerolock.core.protocol.Frames
import org.zerolock.core.protocol.FrameReader
import org.zerolock.core.protocol.FrameWriter
import org.zerolock.core.protocol.Message
import java.io.File
import java.nio.channels.FileChannel
import java.nio.file.Files
import java.nio.file.StandardCopyOption
import java.nio.file.StandardOpenOption

/**
 * The on-disk copy of a stage's replay buffer, as zl_mobile/replay_store.py keeps it: every
 * HIDDEN_STATE the stage sent downstream and the downstream has not committed, one encoded frame
 * per file (`mb-<12 digits>.zlf`, the same frames as on the wire).
 *
 * Why on disk: a fast upstream can have committed windows its downstream has not used yet. If it
 * dies, its restarted process cannot recompute those hidden states (its LoRA has moved on, and its
 * own upstream dropped the inputs when it committed them), so it reloads them from here. The
 * stage syncs the files before it commits a checkpoint; files of windows it had not committed are
 * dropped at load (the restarted stage computes them again, bit for bit).
 */
class ReplayStore(val dir: File) {
    private val lock = Object()
    private val unsynced = HashSet<Long>()

    init {
        dir.mkdirs()
        require(dir.isDirectory) { "cannot make the replay store $dir" }
    }

    private fun path(mb: Long) = File(dir, "mb-%012d.zlf".format(mb))

    fun ids(): List<Long> = (dir.listFiles() ?: emptyArray())
        .mapNotNull { f -> f.name.takeIf { it.startsWith("mb-") && it.endsWith(".zlf") }?.substring(3, f.name.length - 4)?.toLongOrNull() }
        .sorted()

    /** Writes [m] (a HIDDEN_STATE) under its micro-batch; durable after the next [sync]. */
    fun put(m: Message) {
        val mb = m.long("micro_batch")
        val tmp = File(dir, "mb-%012d.tmp".format(mb))
        tmp.outputStream().buffered().use { FrameWriter(it).write(m) }
        synchronized(lock) {
            Files.move(tmp.toPath(), path(mb).toPath(), StandardCopyOption.REPLACE_EXISTING, StandardCopyOption.ATOMIC_MOVE)
            unsynced += mb
        }
    }

    /** Makes every file written so far durable (before a checkpoint commit covers them). */
    fun sync() {
        val todo = synchronized(lock) { unsynced.sorted().also { unsynced.clear() } }
        for (mb in todo) {
            try { FileChannel.open(path(mb).toPath(), StandardOpenOption.READ).use { it.force(true) } } catch (_: java.nio.file.NoSuchFileException) {
                // dropped meanwhile: the downstream committed it
            }
        }
        FileChannel.open(dir.toPath(), StandardOpenOption.READ).use { it.force(true) } // the renames
    }

    /** The downstream committed every micro-batch below [end]: their files go. */
    fun dropBelow(end: Long) = synchronized(lock) {
        for (mb in ids()) {
            if (mb >= end) break
            path(mb).delete()
            unsynced -= mb
        }
    }

    /**
     * What a restarted stage can replay: the unbroken run of stored hidden states that ends at
     * [below] - 1 (its resume point less one). Files at or past [below] belong to a window it had
     * not committed and go; so does anything cut off by a gap (it could not be sent in order).
     */
    fun load(below: Long): List<Message> = synchronized(lock) {
        dir.listFiles { f -> f.name.endsWith(".tmp") }?.forEach { it.delete() }
        val ids = ids()
        for (mb in ids) if (mb >= below) path(mb).delete()
        val run = ArrayList<Long>()
        var expect = below - 1
        for (mb in ids.filter { it < below }.reversed()) {
            if (mb != expect) break
            run += mb
            expect -= 1
        }
        for (mb in ids) if (mb < below && mb !in run) path(mb).delete()
        run.reversed().map { mb -> path(mb).inputStream().buffered().use { FrameReader(it, Frames.DEFAULT_MAX_FRAME).read() } }
    }
}
