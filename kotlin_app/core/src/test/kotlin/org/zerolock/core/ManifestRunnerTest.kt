package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.ManifestRunnerFactory
import org.zerolock.core.device.MethodBackend
import org.zerolock.core.device.StageAssignment
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Tensor
import java.io.File

class ManifestRunnerTest {
    private val manifest = """{"format": "zerolock-export", "export": {"readout_rows": 2, "alpha": 0.3}, "chunks": [{"index": 0, "program": "chunk_0.pte", "weights": "chunk_0.ptd",
      "lora": [{"name": "q.lora_A", "shape": [2, 3]}, {"name": "q.lora_B", "shape": [3, 2]}],
      "methods": {
        "phase1": {"inputs": [{"name": "q.lora_A", "shape": [2, 3]}, {"name": "q.lora_B", "shape": [3, 2]}, {"name": "h_in", "shape": [1, 3]}],
                   "outputs": [{"name": "h_out"}, {"name": "saved_0"}]},
        "phase2": {"inputs": [{"name": "q.lora_A"}, {"name": "q.lora_B"}, {"name": "saved_0"}, {"name": "labels"}, {"name": "loss_weight", "shape": [2]}, {"name": "alpha", "shape": [1]}],
                   "outputs": [{"name": "loss"}, {"name": "task_loss"}, {"name": "consis_loss"}, {"name": "grad:q.lora_A"}, {"name": "grad:q.lora_B"}]}}}]}"""

    /** Records the calls; returns fixed outputs. */
    private class FakeBackend : MethodBackend {
        val calls = mutableListOf<Pair<String, List<Tensor>>>()
        val outputNames = mutableListOf<List<String>>()
        override fun run(method: String, inputs: List<Tensor>, outputNames: List<String>): List<Tensor> {
            calls += method to inputs
            this.outputNames += outputNames
            return if (method == "phase1") listOf(Tensor.ofFloats(floatArrayOf(9f, 8f, 7f), 1, 3), Tensor.ofFloats(floatArrayOf(1f)))
            else listOf(Tensor.ofFloats(floatArrayOf(2f), *longArrayOf()), Tensor.ofFloats(floatArrayOf(1.5f), *longArrayOf()), Tensor.ofFloats(floatArrayOf(0.5f), *longArrayOf()),
                Tensor.ofFloats(FloatArray(6) { 1f }, 2, 3), Tensor.ofFloats(FloatArray(6) { 2f }, 3, 2))
        }
    }

    private fun assign(sha: String, config: Map<String, Any?>? = null) = StageAssignment(Message(MsgType.STAGE_ASSIGN, linkedMapOf(
        "request_id" to 1, "stage" to 0, "num_stages" to 2, "upstream" to null, "downstream" to null, "program_sha256" to sha,
        "config" to config)))

    @Test
    fun `feeds inputs by name and reads outputs by name`(@TempDir dir: File) {
        File(dir, "manifest.json").writeText(manifest)
        File(dir, "chunk_0.pte").writeBytes(byteArrayOf(1, 2, 3))
        File(dir, "chunk_0.ptd").writeBytes(byteArrayOf(4))
        val backend = FakeBackend()
        val f = ManifestRunnerFactory { p, w -> assertEquals("chunk_0.pte", p.name); assertEquals("chunk_0.ptd", w!!.name); backend }
        assertEquals(ErrorCode.REJECTED, assertThrows<ProtocolException> { f.create(assign("0".repeat(64)), dir) }.code)
        val runner = f.create(assign(ManifestRunnerFactory.sha256(File(dir, "chunk_0.pte"))), dir)
        val lora = runner.initialLora()
        assertEquals(2, runner.readoutRows, "from the manifest's export.readout_rows")
        assertEquals(0.3, runner.alpha, "from the manifest's export.alpha")
        assertEquals(listOf("q.lora_A", "q.lora_B"), runner.loraShapes.keys.toList())
        assertArrayEquals(FloatArray(6), lora["q.lora_B"], "B starts at zero")
        val batch = LossBatch.of(0, mapOf("h" to Tensor.ofFloats(floatArrayOf(1f, 2f, 3f), 1, 3),
            "labels" to Tensor.ofLongs(longArrayOf(5, -100, 7), 1, 3)), runner.readoutRows).tensors +
            ("alpha" to Tensor.ofFloats(floatArrayOf(0.3f), 1))
        val p1 = runner.phase1(batch, lora)
        assertArrayEquals(floatArrayOf(9f, 8f, 7f), p1.h.toFloatArray())
        assertEquals(batch["h"], backend.calls[0].second[2], "h_in comes from the HIDDEN_STATE tensor h")
        val p2 = runner.phase2(batch, p1, lora)
        assertEquals(2.0, p2.loss); assertEquals(1.5, p2.taskLoss); assertEquals(0.5, p2.consisLoss)
        assertArrayEquals(FloatArray(6) { 2f }, p2.grads["q.lora_B"])
        assertEquals(listOf(1f), backend.calls[1].second[2].toFloatArray().toList(), "saved activations flow from phase 1")
        assertEquals(listOf(1f, 1f), backend.calls[1].second[4].toFloatArray().toList(), "the stage's readout reaches the program by name")
        assertEquals(listOf(0.3f), backend.calls[1].second[5].toFloatArray().toList(), "alpha reaches phase 2 by name")
        assertEquals(3, backend.calls[0].second.size, "phase 1 does not list alpha, so is not given it")
        assertEquals(listOf(listOf("h_out", "saved_0"), listOf("loss", "task_loss", "consis_loss", "grad:q.lora_A", "grad:q.lora_B")),
            backend.outputNames, "the backend is told the manifest's output names")
        // a wrong input shape is a clear error
        val bad = mapOf("h" to Tensor.ofFloats(floatArrayOf(1f, 2f), 1, 2))
        assertThrows<IllegalArgumentException> { runner.phase1(bad, lora) }
    }

    @Test
    fun `a bad or missing export alpha is refused at STAGE_ASSIGN`(@TempDir dir: File) {
        File(dir, "chunk_0.pte").writeBytes(byteArrayOf(1, 2, 3))
        File(dir, "chunk_0.ptd").writeBytes(byteArrayOf(4))
        val sha = ManifestRunnerFactory.sha256(File(dir, "chunk_0.pte"))
        val f = ManifestRunnerFactory { _, _ -> FakeBackend() }
        fun create(alpha: String?, config: Map<String, Any?>? = null) = run {
            val export = if (alpha == null) """{"readout_rows": 2}""" else """{"readout_rows": 2, "alpha": $alpha}"""
            File(dir, "manifest.json").writeText(manifest.replace("""{"readout_rows": 2, "alpha": 0.3}""", export))
            f.create(assign(sha, config), dir)
        }
        for (bad in listOf("1.5", "-0.1", "\"0.5\"", "true")) {
            val e = assertThrows<ProtocolException> { create(bad) }
            assertEquals(ErrorCode.REJECTED, e.code)
            assertTrue(e.message!!.contains("manifest.json export.alpha must be a number from 0 to 1, got"), e.message)
            assertEquals(false, e.message!!.contains("\n"), "one line")
        }
        assertEquals(1.0, create("1").alpha, "an integer 0 or 1 is a number")
        val missing = assertThrows<ProtocolException> { create(null) }
        assertEquals(ErrorCode.REJECTED, missing.code)
        assertTrue(missing.message!!.contains("no export.alpha and STAGE_ASSIGN no config.alpha"), missing.message)
        assertEquals(null, create(null, mapOf("alpha" to 0.7)).alpha, "config.alpha stands in for a missing export.alpha")
        // a program without an alpha input needs none
        File(dir, "manifest.json").writeText(manifest.replace(""", "alpha": 0.3""", "").replace(""", {"name": "alpha", "shape": [1]}""", ""))
        assertEquals(null, f.create(assign(sha), dir).alpha)
    }

    /** PROTOCOL.md 5.2: a manifest's file names are plain names listed in its files; anything else is
     *  refused before any file is looked at (it used to strip the directory and load the pushed file). */
    @Test
    fun `a manifest naming a path or an unlisted file is refused before any file is read`(@TempDir dir: File) {
        File(dir, "chunk_0.pte").writeBytes(byteArrayOf(1, 2, 3))
        File(dir, "chunk_0.ptd").writeBytes(byteArrayOf(4))
        File(dir, "sub").mkdirs()
        File(dir, "sub/chunk_0.pte").writeBytes(byteArrayOf(1, 2, 3))
        val sha = ManifestRunnerFactory.sha256(File(dir, "chunk_0.pte"))
        val f = ManifestRunnerFactory { p, _ -> throw AssertionError("${p.path} was loaded") }
        val listed = manifest.replace("\"chunks\":", "\"files\": [{\"path\": \"chunk_0.pte\"}, {\"path\": \"chunk_0.ptd\"}], \"chunks\":")
        for ((key, name, text) in listOf(
                Triple("program", "sub/chunk_0.pte", "\"sub/chunk_0.pte\""),
                Triple("program", "x/../chunk_0.pte", "\"x/../chunk_0.pte\""),
                Triple("program", "..", "\"..\""),
                Triple("weights", "../chunk_0.ptd", "\"../chunk_0.ptd\""),
                Triple("weights", "a\\b", "\"a\\\\b\""),
                Triple("program", "other.pte", "\"other.pte\""))) { // plain, but not in the manifest's files
            val field = "\"$key\": \"chunk_0.${if (key == "program") "pte" else "ptd"}\""
            assertTrue(field in listed, field)
            File(dir, "manifest.json").writeText(listed.replace(field, "\"$key\": ${Json.write(name)}"))
            val e = assertThrows<ProtocolException> { f.create(assign(sha), dir) }
            assertEquals(ErrorCode.REJECTED, e.code)
            assertTrue(e.detail.startsWith("manifest.json names $text as chunk 0's $key, which is not a plain file name listed in its files"), e.detail)
            assertEquals(1L, e.requestId)
        }
    }
}
