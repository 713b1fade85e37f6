package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.ReplayStore
import org.zerolock.core.protocol.Messages
import org.zerolock.core.protocol.Tensor
import java.io.File

/** The replay buffer's on-disk copy: what a restarted upstream reloads, as zl_mobile's ReplayStore. */
class ReplayStoreTest {
    private fun hs(mb: Long) = Messages.hiddenState(mb, mb / 2, Tensor.ofFloats(floatArrayOf(mb.toFloat(), 1f), 1, 2), emptyMap())

    @Test
    fun `a restart reloads the unbroken run below its resume point, frames intact`(@TempDir dir: File) {
        val s = ReplayStore(File(dir, "r"))
        for (mb in listOf(1L, 3, 4, 5, 6, 7)) s.put(hs(mb))
        s.sync()
        File(dir, "r/mb-000000000009.tmp").writeText("half a frame") // a crash mid-write
        // resume point 6 (window 2 of W=2 not committed): 6 and 7 are computed again; 1 is cut off by the gap at 2
        val back = ReplayStore(File(dir, "r")).load(6)
        assertEquals(listOf(3L, 4L, 5L), back.map { it.long("micro_batch") })
        assertEquals(hs(4).tensors["h"], back[1].tensors["h"], "the frame comes back as it was sent")
        assertEquals(listOf(3L, 4L, 5L), s.ids(), "what cannot be replayed is gone from disk")
        s.dropBelow(4) // the downstream committed window 1 (micro-batches 2, 3)
        assertEquals(listOf(4L, 5L), s.ids())
        assertEquals(emptyList<Long>(), ReplayStore(File(dir, "r")).load(4).map { it.long("micro_batch") }.filter { it >= 4 })
    }
}
