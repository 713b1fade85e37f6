package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertArrayEquals
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.ManifestChunkRunner
import org.zerolock.core.device.ManifestRunnerFactory
import org.zerolock.core.device.MethodInput
import org.zerolock.core.device.StageAssignment
import org.zerolock.core.executorch.ExecuTorchBackend
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.Tensor
import java.io.File

/**
 * The JVM's ExecuTorch backend (kotlin_app/jni, the executorch wheel's C++ runtime) on a real
 * two-chunk export that run_tests.sh makes (jni/make_test_export.py), against the Python runtime's
 * outputs on the same inputs: every output bit for bit. And every misuse is an exception.
 */
class ExecuTorchBackendTest {
    private val dir: File = File(System.getProperty("zerolock.testExport") ?: error("run through kotlin_app/run_tests.sh (-Dzerolock.testExport)"))
    private val export = File(dir, "export")
    private val ref: Map<String, Tensor> by lazy { Safetensors.read(File(dir, "reference.safetensors")) }
    private val manifest by lazy { Json.parse(File(export, "manifest.json").readText()).asObject() }
    @Suppress("UNCHECKED_CAST")
    private fun chunk(k: Int) = (manifest["chunks"] as List<Any?>)[k].asObject()
    @Suppress("UNCHECKED_CAST")
    private fun names(k: Int, method: String, key: String) =
        ((chunk(k)["methods"].asObject()[method].asObject()[key]) as List<Any?>).map { it.asObject().str("name") }

    private fun load(k: Int) = ExecuTorchBackend.load(File(export, "chunk_$k.pte"), File(export, "chunk_$k.ptd"))
    private fun input(k: Int, name: String) = ref["$k/in/$name"] ?: error("no reference input $k/in/$name")

    private fun assertSameBytes(want: Tensor, got: Tensor, what: String) {
        assertEquals(want.dtype, got.dtype, what)
        assertTrue(want.data.contentEquals(got.data), "$what differs from the Python runtime's output")
    }

    @Test
    fun `both phases of both chunks match the Python runtime bit for bit`() {
        for (k in 0..1) load(k).use { b ->
            assertTrue(b.sharedArenas, "chunk $k: zl-export plans phase 1's outputs apart, so both phases share one working arena")
            val p1Names = names(k, "phase1", "outputs")
            val p1 = b.run("phase1", names(k, "phase1", "inputs").map { input(k, it) }, p1Names)
            assertEquals(p1Names.size, p1.size)
            for ((n, t) in p1Names.zip(p1)) {
                assertSameBytes(ref["$k/phase1/$n"]!!, t, "chunk $k phase1 $n")
                assertArrayEquals(ref["$k/phase1/$n"]!!.shape, t.shape, "chunk $k phase1 $n shape")
            }
            val byName = p1Names.zip(p1).toMap()
            val p2Names = names(k, "phase2", "outputs")
            val p2 = b.run("phase2", names(k, "phase2", "inputs").map { byName[it] ?: input(k, it) }, p2Names)
            for ((n, t) in p2Names.zip(p2)) assertSameBytes(ref["$k/phase2/$n"]!!, t, "chunk $k phase2 $n")
        }
    }

    @Test
    fun `the manifest runner keeps saved activations in ExecuTorch and gets the same results`(@TempDir tmp: File) {
        // ManifestRunnerFactory on the pushed files, as a Kotlin phone runs a chunk
        for (f in export.listFiles()!!) if (f.isFile) f.copyTo(File(tmp, f.name))
        for (k in 0..1) {
            val assign = StageAssignment(Message(MsgType.STAGE_ASSIGN, linkedMapOf("request_id" to 1, "stage" to k, "num_stages" to 2,
                "upstream" to null, "downstream" to null, "program_sha256" to ManifestRunnerFactory.sha256(File(tmp, "chunk_$k.pte")))))
            val runner = ManifestRunnerFactory { p, w -> ExecuTorchBackend.load(p, w) }.create(assign, tmp)
            val init = Safetensors.readFloats(File(tmp, "chunk_${k}_lora_init.safetensors"))
            for ((n, v) in runner.initialLora()) assertArrayEquals(init[n], v, "the stage starts from the export's lora_init ($n)")
            val lora = runner.loraShapes.keys.associateWith { input(k, it).toFloatArray() }
            val batch = names(k, "phase1", "inputs").filter { it !in lora }.associateWith { input(k, it) }.toMutableMap()
            for (n in names(k, "phase2", "inputs")) if (n !in lora && ref.containsKey("$k/in/$n")) batch[n] = input(k, n)
            batch["h"] = batch.remove("h_in") ?: batch["input_ids"]!! // the stage's HIDDEN_STATE carries h_{k-1} as "h"
            try {
                val p1 = runner.phase1(batch, lora)
                assertSameBytes(ref["$k/phase1/h_out"]!!, p1.h, "chunk $k h_out")
                assertTrue(p1.kept.size == names(k, "phase1", "outputs").size - 1, "every saved activation stays in ExecuTorch's memory")
                val p2 = runner.phase2(batch, p1, lora)
                for ((n, g) in p2.grads) assertSameBytes(ref["$k/phase2/grad:$n"]!!, Tensor.ofFloats(g, *runner.loraShapes[n]!!), "chunk $k grad:$n")
                assertEquals(ref["$k/phase2/loss"]!!.toFloatArray()[0].toDouble(), p2.loss)
                // phase 2 works in the arena phase 1 worked in: what it reads of phase 1 lies apart, unharmed
                val p2again = runner.phase2(batch, p1, lora)
                for ((n, g) in p2.grads) assertArrayEquals(g, p2again.grads[n], "chunk $k grad:$n, phase 2 run twice on one phase 1")
                // a second phase 1 replaces the first one's kept activations: its phase 2 is refused, never run on them
                val again = runner.phase1(batch, lora)
                val stale = assertThrows<IllegalStateException> { runner.phase2(batch, p1, lora) }
                assertTrue(stale.message!!.contains("has run since"), stale.message)
                assertEquals(p2.loss, runner.phase2(batch, again, lora).loss, "the current phase 1's phase 2 runs")
                // token ids outside the vocabulary: the kernel would read past its table
                if (k == 0) {
                    val ids = input(0, "input_ids").toLongArray().also { it[3] = 512 }
                    val e = assertThrows<IllegalArgumentException> { runner.phase1(batch + ("input_ids" to Tensor.ofLongs(ids, 2, 16)), lora) }
                    assertTrue(e.message!!.contains("token id 512") && e.message!!.contains("0..511"), e.message)
                }
            } finally {
                runner.close()
            }
        }
    }

    @Test
    fun `misuse is an exception naming the problem, and the program still runs after it`() {
        val pte = File(export, "chunk_0.pte")
        val missing = assertThrows<IllegalArgumentException> { ExecuTorchBackend.load(pte, File(export, "nope.ptd")) }
        assertTrue(missing.message!!.contains("nope.ptd"), missing.message)
        val wrongWeights = assertThrows<IllegalArgumentException> { ExecuTorchBackend.load(pte, File(export, "chunk_1.ptd")).close() }
        assertTrue(wrongWeights.message!!.contains("could not load"), wrongWeights.message)
        val notAProgram = assertThrows<IllegalArgumentException> { ExecuTorchBackend.load(File(export, "manifest.json"), null) }
        assertTrue(notAProgram.message!!.contains("could not load"), notAProgram.message)

        val b = load(0)
        val inNames = names(0, "phase1", "inputs")
        val good = inNames.map { input(0, it) }
        val outNames = names(0, "phase1", "outputs")
        fun expect(what: String, inputs: List<Tensor>, method: String = "phase1") {
            val e = assertThrows<IllegalArgumentException> { b.run(method, inputs, emptyList()) }
            assertTrue(e.message!!.contains(what), "'${e.message}' should say '$what'")
            assertEquals(false, e.message!!.contains("\n"), "one line")
        }
        expect("no method 'phase3'", good, "phase3")
        expect("takes ${good.size} inputs, got ${good.size - 1}", good.dropLast(1))
        val ids = inNames.indexOf("input_ids")
        val asInt32 = Tensor.ofInts(input(0, "input_ids").toLongArray().map { it.toInt() }.toIntArray(), 2, 16)
        expect("is int32, the program takes int64", good.toMutableList().also { it[ids] = asInt32 })
        expect("has shape [2, 8], the program takes [2, 16]", good.toMutableList().also { it[ids] = Tensor.ofLongs(LongArray(16), 2, 8) })
        // a kept output that does not exist, or of a method that has not run
        val e = assertThrows<IllegalStateException> {
            b.runKeeping("phase2", names(0, "phase2", "inputs").map { MethodInput.Kept("phase1", 0, 1) }, emptyList(), BooleanArray(0))
        }
        assertTrue(e.message!!.contains("has not run"), e.message)
        // after all that, the same program still gives the reference result
        val h = b.run("phase1", good, outNames)[0]
        assertSameBytes(ref["0/phase1/h_out"]!!, h, "h_out after errors")
        assertEquals(DType.FLOAT32, h.dtype)
        b.close()
        assertTrue(assertThrows<IllegalStateException> { b.run("phase1", good, outNames) }.message!!.contains("was closed"))
    }
}

private inline fun <R> ExecuTorchBackend.use(f: (ExecuTorchBackend) -> R): R = try { f(this) } finally { close() }
