package trainer

import (
	"encoding/json"
	"fmt"
	"io"
)

// SampleLog records which samples each micro-batch trained on, one JSON line per micro-batch
// as it is filled: {"gen","step","epoch","rank","world","micro","idx"}. Elastic training's
// soak test reads the lines of every process to check that no sample of an epoch was lost or
// trained twice across re-forms: for each step the lines of the newest generation count (a
// step rolled back is trained again under a later one). Lines are written unbuffered, so a
// process killed after a step still has that step's lines on disk.
type SampleLog struct {
	W   io.Writer
	Gen uint64 // the group's generation (cluster roster Gen)
}

type sampleLine struct {
	Gen   uint64  `json:"gen"`
	Step  int64   `json:"step"`
	Epoch int     `json:"epoch"`
	Rank  int     `json:"rank"`
	World int     `json:"world"`
	Micro int     `json:"micro"`
	Idx   []int32 `json:"idx"`
}

// record writes micro-batch j of the step about to run.
func (l *SampleLog) record(t *Trainer, j int, idx []int32) error {
	b, err := json.Marshal(sampleLine{Gen: l.Gen, Step: t.pos.step + 1, Epoch: t.pos.epoch, Rank: t.group.rank, World: t.group.world, Micro: j, Idx: idx})
	if err != nil {
		return err
	}
	if _, err := l.W.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("writing the sample log: %w", err)
	}
	return nil
}
