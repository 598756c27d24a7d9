package main

import (
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/metrics"
)

// TestEstimateTable: the DeepSpeed-style table for 1.3B parameters on 8 ranks in fp16 with
// AdamW and accumulation has the ZeRO paper's figures (stage 1: 4Ψ+12Ψ/N = 7.15e9 B) and
// marks the row asked for; without accumulation stage 1 holds what stage 2 does.
func TestEstimateTable(t *testing.T) {
	code, out, errs := runQVD(t, "estimate", "--params", "1.3e9", "--world", "8", "--stage", "2", "--offload", "cpu", "--precision", "fp16", "--bytes", "--accum", "2")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	const psi, n = 1_300_000_000, 8
	row := func(stage int, off string) []string {
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, "stage="+strconv.Itoa(stage)+" offload_optimizer="+off) {
				return strings.Fields(l)
			}
		}
		t.Fatalf("no row for stage %d offload %s:\n%s", stage, off, out)
		return nil
	}
	if f := row(0, "none"); f[0] != strconv.Itoa(16*psi) || !strings.Contains(strings.Join(f, " "), "16Ψ") {
		t.Errorf("stage 0 row %v, want %d bytes on the device", f, 16*psi)
	}
	if f := row(1, "none"); f[0] != strconv.Itoa(4*psi+12*psi/n) {
		t.Errorf("stage 1 row %v, want %d", f, 4*psi+12*psi/n)
	}
	_, out1, _ := runQVD(t, "estimate", "--params", "1.3e9", "--world", "8", "--precision", "fp16", "--bytes", "--accum", "1")
	var s1, s2 string
	for _, l := range strings.Split(out1, "\n") {
		if strings.Contains(l, "stage=1 offload_optimizer=none") {
			s1 = strings.Fields(l)[0]
		}
		if strings.Contains(l, "stage=2 offload_optimizer=none") {
			s2 = strings.Fields(l)[1]
		}
	}
	if s1 == "" || s1 != s2 {
		t.Errorf("accum 1: stage 1 %q bytes, stage 2 %q: the same gradient partition should give the same figure\n%s", s1, s2, out1)
	}
	if f := row(2, "cpu"); f[0] != "*" || f[2] != strconv.Itoa(16*psi/n+2*psi/n) {
		// host: fp32 gradient shard, master and moments (16Ψ/N) and the fp16 staging copy (2Ψ/N)
		t.Errorf("stage 2 offload row %v: want it marked, with %d host bytes", f, 16*psi/n+2*psi/n)
	}
	for args, want := range map[string]string{
		"--params abc":                                               "--params",
		"--params 1e6 -c fashion-mlp":                                "exactly one",
		"--params 1e6 --memory 3GB":                                  "go with --recommend",
		"--params 1e6 --offload nvme":                                "--offload",
		"--params 1e6 --recommend":                                   "--memory",
		"--params 1e6 --world 0":                                     "--world",
		"--params 1e6 --recommend --memory 1GiB --effective-batch 8": "--activation-bytes",
	} {
		code, _, errs := runQVD(t, append([]string{"estimate"}, strings.Fields(args)...)...)
		if code != exitUsage || !strings.Contains(errs, want) {
			t.Errorf("estimate %s: exit %d, %q (want a message naming %s)", args, code, errs, want)
		}
	}
}

// TestEstimateRecommend: the recommendation keeps the effective batch exactly, fits the
// budget less 20%, and takes the largest micro-batch that does.
func TestEstimateRecommend(t *testing.T) {
	code, out, errs := runQVD(t, "estimate", "--params", "1e6", "--stage", "2", "--world", "2", "--recommend", "--memory", "100MB",
		"--effective-batch", "96", "--activation-bytes", "1MiB", "--bytes")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errs)
	}
	num := func(key string) int64 {
		m := regexp.MustCompile(key + `:? (\d+)`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no %s in:\n%s", key, out)
		}
		v, _ := strconv.ParseInt(m[1], 10, 64)
		return v
	}
	micro, accum, states := num("micro_batch"), num("accum"), num(`model states \(qvd CPU engine\)`)
	if micro*accum*2 != 96 {
		t.Fatalf("micro %d × accum %d × 2 ranks != 96", micro, accum)
	}
	usable := int64(0.8 * 100e6)
	if states+micro*(1<<20) > usable {
		t.Fatalf("micro %d does not fit: states %d + activations > %d", micro, states, usable)
	}
	for d := micro + 1; d <= 48; d++ {
		if 48%d == 0 && states+d*(1<<20) <= usable {
			t.Fatalf("micro %d fits too, but %d was recommended", d, micro)
		}
	}
	code, _, errs = runQVD(t, "estimate", "--params", "1e9", "--recommend", "--memory", "1GiB", "--effective-batch", "8", "--activation-bytes", "1MiB")
	if code != exitUsage || !strings.Contains(errs, "model states alone") {
		t.Fatalf("an impossible budget: exit %d, %s", code, errs)
	}
}

// TestEstimateMatchesTraining: the estimate for the shipped ZeRO-2 + offload config is what a
// run of it actually allocates, as its metrics file records.
func TestEstimateMatchesTraining(t *testing.T) {
	needDataset(t)
	out := t.TempDir()
	code, _, errs := runQVD(t, "train", "-c", "fashion-mlp-zero2", "--max-steps", "3", "--train-subset", "256", "--test-subset", "100", "--out", out, "--quiet")
	if code != exitOK {
		t.Fatalf("train: exit %d\n%s", code, errs)
	}
	recs, err := metrics.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var measured int64
	for _, r := range recs {
		if r.Kind == metrics.KindTrain {
			measured = 0
			for _, v := range r.Memory {
				measured += v
			}
		}
	}
	_, table, _ := runQVD(t, "estimate", "-c", "fashion-mlp-zero2", "--bytes")
	for _, l := range strings.Split(table, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "*") {
			if f := strings.Fields(l); f[3] != strconv.FormatInt(measured, 10) {
				t.Fatalf("estimate (qvd CPU engine) %s, the run allocated %d bytes\n%s", f[3], measured, table)
			}
			return
		}
	}
	t.Fatalf("no marked row:\n%s", table)
}
