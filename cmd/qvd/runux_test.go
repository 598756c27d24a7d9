package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/launch"
)

// tiny is a run of a few seconds on the real data.
var tiny = []string{"--train-subset", "512", "--test-subset", "200", "--quiet"}

// splitHint splits a printed command line back into words (resumeCommand's quoting).
func splitHint(t *testing.T, line string) []string {
	t.Helper()
	var words []string
	var cur strings.Builder
	in, word := false, false
	for i := 0; i < len(line); i++ {
		switch c := line[i]; {
		case c == '\'':
			in, word = !in, true
		case c == ' ' && !in:
			if word {
				words = append(words, cur.String())
			}
			cur.Reset()
			word = false
		case c == '\\' && !in && i+1 < len(line):
			i++
			cur.WriteByte(line[i])
			word = true
		default:
			cur.WriteByte(c)
			word = true
		}
	}
	if in {
		t.Fatalf("unbalanced quotes in %q", line)
	}
	if word {
		words = append(words, cur.String())
	}
	return words
}

// hintIn returns the command printed after "resume with: " in out.
func hintIn(t *testing.T, out string) string {
	t.Helper()
	m := regexp.MustCompile(`resume with: (.*)`).FindAllStringSubmatch(out, -1)
	if len(m) != 1 {
		t.Fatalf("want exactly one resume hint, got %d:\n%s", len(m), out)
	}
	return m[0][1]
}

func TestResumeCommandQuoting(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-c", "fashion-mlp", "--out", "runs/x"}, "qvd train -c fashion-mlp --out runs/x --resume auto"},
		{[]string{"--out", "my runs/it's", "--resume", "/ck/step-1", "--lr=0.01"}, `qvd train --out 'my runs/it'\''s' --lr=0.01 --resume auto`},
		{[]string{"--resume=auto", "--quiet", "-resume", "x", "--epochs", "2"}, "qvd train --quiet --epochs 2 --resume auto"},
		{[]string{"--data", ""}, "qvd train --data '' --resume auto"},
		{[]string{"--out", "r", "--overwrite", "--epochs", "2"}, "qvd train --out r --epochs 2 --resume auto"},
		{[]string{"--overwrite=true", "--out", "r"}, "qvd train --out r --resume auto"},
	} {
		got := launch.ResumeCommand("qvd train", c.args)
		if got != c.want {
			t.Errorf("launch.ResumeCommand(%q) = %s, want %s", c.args, got, c.want)
		}
		if w := splitHint(t, got); !strings.Contains(strings.Join(w, "\x00"), "--resume\x00auto") {
			t.Errorf("%s does not split back into words with --resume auto: %q", got, w)
		}
	}
}

// interruptAtCheckpoint runs qvd in this process and interrupts it, as Ctrl-C does, once a
// checkpoint after step `after` is committed in dir.
func interruptAtCheckpoint(t *testing.T, dir string, after int64, args []string) (int, string, string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		for i := 0; i < 3000 && ctx.Err() == nil; i++ {
			steps, _ := filepath.Glob(filepath.Join(dir, "step-*"))
			if len(steps) > 0 && filepath.Base(steps[len(steps)-1]) > checkpoint.StepDirName(after) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		cancel()
	}()
	var so, se bytes.Buffer
	code := run(ctx, args, &so, &se)
	return code, so.String(), se.String()
}

// TestResumeHintResumes (hardening item 3): the command printed after Ctrl-C is the command
// line that was run, same --out and overrides, with --resume auto; running it resumes the run
// (and, interrupted again, prints the same hint).
func TestResumeHintResumes(t *testing.T) {
	needDataset(t)
	out := filepath.Join(t.TempDir(), "run x") // a space: the hint must quote it
	args := append([]string{"train", "-c", "fashion-mlp", "--out", out, "--max-steps", "5000", "--epochs", "1000",
		"--checkpoint-every", "3", "--lr", "0.002"}, tiny...)
	code, stdout, stderr := interruptAtCheckpoint(t, filepath.Join(out, "checkpoints"), -1, args)
	if code != exitInterrupted {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	hint := hintIn(t, stdout)
	words := splitHint(t, hint)
	want := append([]string{"qvd"}, append(args, "--resume", "auto")...)
	if strings.Join(words, "\x00") != strings.Join(want, "\x00") {
		t.Fatalf("hint %s\nsplits into %q\nwant %q", hint, words, want)
	}
	ck, _, err := checkpoint.Latest(filepath.Join(out, "checkpoints"))
	if err != nil {
		t.Fatal(err)
	}

	code, stdout, stderr = interruptAtCheckpoint(t, filepath.Join(out, "checkpoints"), ck.Step(), words[1:])
	if code != exitInterrupted {
		t.Fatalf("running the hint: exit %d\n%s\n%s", code, stdout, stderr)
	}
	if !strings.Contains(stderr, "resumed") || !regexp.MustCompile(`"start_step": `+strconv.FormatInt(ck.Step(), 10)).MatchString(stderr) {
		t.Fatalf("the hint did not resume from step %d:\n%s", ck.Step(), stderr)
	}
	if again := hintIn(t, stdout); again != hint {
		t.Fatalf("interrupted again, the hint changed:\n%s\n%s", hint, again)
	}
}

// TestResumeAutoWithoutCheckpointWarns (item 3): --resume auto that finds nothing says so at
// WARN, naming the directory it looked in.
func TestResumeAutoWithoutCheckpointWarns(t *testing.T) {
	needDataset(t)
	out := t.TempDir()
	code, stdout, stderr := runQVD(t, append([]string{"train", "--out", out, "--max-steps", "1", "--resume", "auto"}, tiny...)...)
	if code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	dir := filepath.Join(out, "checkpoints")
	if !regexp.MustCompile(`WARN\t[^\n]*no checkpoint in ` + regexp.QuoteMeta(dir)).MatchString(stderr) {
		t.Fatalf("no WARN naming %s:\n%s", dir, stderr)
	}
}

// TestLaunchResumeHint (item 3): an interrupted `qvd launch` prints one hint, the launch
// command itself; the workers print none of their own.
func TestLaunchResumeHint(t *testing.T) {
	needDataset(t)
	t.Setenv(asQVD, "1")
	out := t.TempDir()
	args := append([]string{"launch", "--nproc", "2", "--out", out, "--epochs", "1000", "--checkpoint-every", "2"}, tiny...)
	code, stdout, stderr := interruptAtCheckpoint(t, filepath.Join(out, "checkpoints"), -1, args)
	if code != exitInterrupted {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	hint := hintIn(t, stdout+stderr)
	want := append([]string{"qvd"}, append(args, "--resume", "auto")...)
	if got := splitHint(t, hint); strings.Join(got, "\x00") != strings.Join(want, "\x00") {
		t.Fatalf("hint %q, want %q", got, want)
	}
	if !strings.Contains(stdout, "[rank 0] interrupted at step") {
		t.Fatalf("rank 0 should still report its step:\n%s", stdout)
	}
}

// failingFile makes path a symlink to /dev/full, where every write fails with ENOSPC.
func failingFile(t *testing.T, path string) {
	t.Helper()
	if f, err := os.OpenFile("/dev/full", os.O_WRONLY, 0); err != nil {
		t.Skipf("no /dev/full: %v", err)
	} else {
		f.Close()
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/dev/full", path); err != nil {
		t.Fatal(err)
	}
}

// TestRecordWriteFailure (items 4 and 7): a metrics file or log that cannot be written fails
// the run at once with an ERROR naming the file, after a checkpoint, with a non-zero exit;
// the finished line reports the real counts.
func TestRecordWriteFailure(t *testing.T) {
	needDataset(t)
	for _, c := range []struct {
		name, file string
		steps      int64
	}{
		{"short run, metrics", "metrics.jsonl", 4},     // found when the buffered records are flushed at the end
		{"longer run, metrics", "metrics.jsonl", 2000}, // found mid-run
		{"log", "train.log", 4},
	} {
		t.Run(c.name, func(t *testing.T) {
			out := t.TempDir()
			path := filepath.Join(out, c.file)
			failingFile(t, path)
			code, stdout, stderr := runQVD(t, append([]string{"train", "--out", out, "--max-steps", strconv.FormatInt(c.steps, 10), "--epochs", "1000"}, tiny...)...)
			if code != exitFailure {
				t.Fatalf("exit %d, want %d\n%s\n%s", code, exitFailure, stdout, stderr)
			}
			if !regexp.MustCompile(`ERROR\t[^\n]*` + regexp.QuoteMeta(path) + `[^\n]*no space left on device`).MatchString(stderr) {
				t.Fatalf("no ERROR naming %s and the error:\n%s", path, stderr)
			}
			if c.file == "train.log" {
				// The lines logged while building the run did not reach the file: it fails
				// before training.
				if strings.Contains(stderr, "\ttraining\t") {
					t.Fatalf("trained with a log file that cannot be written:\n%s", stderr)
				}
				return
			}
			ck, _, err := checkpoint.Latest(filepath.Join(out, "checkpoints"))
			if err != nil {
				t.Fatalf("no checkpoint: %v\n%s", err, stderr)
			}
			if c.steps > 4 && ck.Step() >= c.steps {
				t.Fatalf("the run went on to step %d after the failed write", ck.Step())
			}
			finished := regexp.MustCompile(`finished\t[^\n]*`).FindString(stderr)
			for _, want := range []string{`"steps": ` + strconv.FormatInt(ck.Step(), 10), `"micro_batch": 64`, `"accum": 1`} {
				if !strings.Contains(finished, want) {
					t.Fatalf("finished line %q lacks %s", finished, want)
				}
			}
		})
	}
}

// mountTmpfs mounts a tmpfs at dir for the test (root only).
func mountTmpfs(t *testing.T, dir, opts string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if b, err := exec.Command("mount", "-t", "tmpfs", "-o", opts, "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("mount -t tmpfs -o %s: %v %s", opts, err, b)
	}
	t.Cleanup(func() { exec.Command("umount", dir).Run() })
}

// TestCheckpointDirCheckedAtStart (item 6): a read-only or too small checkpoint directory is
// a clear error before the first step, not at the first save.
func TestCheckpointDirCheckedAtStart(t *testing.T) {
	needDataset(t)
	for _, c := range []struct{ name, opts, want string }{
		{"read-only", "ro,size=1m", "read-only file system"},
		{"full", "size=64k", "not enough free space"}, // the MLP's checkpoint is ~2.8 MB
	} {
		t.Run(c.name, func(t *testing.T) {
			out := t.TempDir()
			dir := filepath.Join(out, "checkpoints")
			mountTmpfs(t, dir, c.opts)
			code, stdout, stderr := runQVD(t, append([]string{"train", "--out", out, "--max-steps", "4"}, tiny...)...)
			if code == exitOK || !strings.Contains(stderr, dir) || !strings.Contains(stderr, c.want) {
				t.Fatalf("exit %d, want a failure naming %s and %q\n%s\n%s", code, dir, c.want, stdout, stderr)
			}
			if strings.Contains(stderr, "\ttraining\t") {
				t.Fatalf("training started before the check:\n%s", stderr)
			}
		})
	}
}

// TestResumeFinishedRun (item 7): resuming a run that already finished says so with the
// last evaluation from the metrics, not a test accuracy of 0.
func TestResumeFinishedRun(t *testing.T) {
	needDataset(t)
	out := t.TempDir()
	args := append([]string{"train", "--out", out, "--max-steps", "4"}, tiny...)
	if code, stdout, stderr := runQVD(t, args...); code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	recs, err := metrics.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var eval metrics.Record
	for _, r := range recs {
		if r.Kind == metrics.KindEval {
			eval = r
		}
	}
	if eval.Step != 4 || eval.Accuracy == 0 {
		t.Fatalf("no evaluation at step 4 in %+v", recs)
	}
	code, stdout, stderr := runQVD(t, append(args, "--resume", "auto")...)
	if code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	want := "already finished at step 4"
	acc := fmt.Sprintf("test accuracy %.4f", eval.Accuracy)
	if !strings.Contains(stdout, want) || !strings.Contains(stdout, "last evaluation at step 4") || !strings.Contains(stdout, acc) || strings.Contains(stdout, "test accuracy 0.0000") {
		t.Fatalf("resuming a finished run: want %q and %q\n%s\n%s", want, acc, stdout, stderr)
	}
}
