package extender

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
	"unicode/utf8"

	corev1 "k8s.io/api/core/v1"
	extenderv1 "k8s.io/kube-scheduler/extender/v1"
)

// The extender verbs' JSON, read and written faster than encoding/json where the bodies are large
// (node-name lists of thousands, filter replies refusing thousands of nodes); each shortcut is
// tested equal to encoding/json (wire_test.go).

// maxBodyBytes bounds a request body; a filter call for 5,000 full Node objects stays well below.
const maxBodyBytes = 256 << 20

// bodies are request and reply buffers reused across calls: a filter call for 5,000 node names
// is a few hundred KiB each way, and fresh buffers per call made garbage the GC had to chase.
var bodies = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// readBody reads a request body (bounded) into a pooled buffer; put it back when decoded.
func readBody(r *http.Request) (*bytes.Buffer, error) {
	buf := bodies.Get().(*bytes.Buffer)
	buf.Reset()
	if r.ContentLength > 0 && r.ContentLength <= maxBodyBytes {
		buf.Grow(int(r.ContentLength) + 1)
	}
	_, err := buf.ReadFrom(io.LimitReader(r.Body, maxBodyBytes))
	return buf, err
}

// decodeVerb decodes a verb's arguments: filter's and prioritize's by decodeArgs, the others by
// encoding/json; release is decodeArgs' (a no-op for the others).
func (x *Extender) decodeVerb(w http.ResponseWriter, r *http.Request, args any) (release func(), ok bool) {
	if a, isArgs := args.(*extenderv1.ExtenderArgs); isArgs {
		return x.decodeArgs(w, r, a)
	}
	return func() {}, x.decode(w, r, args)
}

func (x *Extender) decode(w http.ResponseWriter, r *http.Request, v any) bool {
	buf, err := readBody(r)
	defer bodies.Put(buf)
	if err == nil {
		err = json.Unmarshal(buf.Bytes(), v)
	}
	return x.decoded(w, r, err)
}

func (x *Extender) decoded(w http.ResponseWriter, r *http.Request, err error) bool {
	if err != nil {
		x.log().Warn("bad extender request", "path", r.URL.Path, "err", err)
		http.Error(w, "invalid extender request: "+err.Error(), http.StatusBadRequest)
		return false
	}
	return true
}

// argsWire is ExtenderArgs as filter and prioritize decode it: the node names (nodeCacheCapable
// sends thousands) are read by nameList, which reuses the state's strings for known nodes.
type argsWire struct {
	Pod       *corev1.Pod
	Nodes     *corev1.NodeList
	NodeNames *nameList
}

// nameList decodes a JSON array of node names, reusing the State's name strings (one read lock
// for the whole list) instead of allocating one string per name per call; lists decoded before are
// taken from recent.
type nameList struct {
	state  *State
	recent *nameLists
	set    bool
	names  []string
}

func (l *nameList) UnmarshalJSON(data []byte) error {
	l.set = true
	if names, ok := l.recent.get(data, l.names[:0]); ok {
		l.names = names
		return nil
	}
	var names []string
	var ok bool
	// Each name takes at least 3 of the array's bytes (its quotes and a comma or bracket).
	l.state.internNames(len(data)/3, func(intern func([]byte) string) []string {
		names, ok = appendPlainStrings(l.names[:0], data, intern)
		if !ok {
			return nil
		}
		return names
	})
	if !ok { // escapes or anything unusual: the standard decoder, strictly
		l.names = nil
		return json.Unmarshal(data, &l.names)
	}
	l.names = names
	l.recent.put(data, names)
	return nil
}

// nameLists remembers the last few node-name lists as received (the JSON array's bytes) and as
// decoded: the kube-scheduler sends the same list, byte for byte, call after call, and comparing
// 5,000 names' bytes costs far less than looking each up (a third of a warm filter call's CPU).
type nameLists struct {
	mu    sync.Mutex
	slots [2]struct {
		raw   []byte
		names []string
	}
	next int
}

// get appends the decoded names of raw to dst when raw is a remembered list.
func (c *nameLists) get(raw []byte, dst []string) ([]string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range c.slots {
		if sl := &c.slots[i]; sl.names != nil && bytes.Equal(sl.raw, raw) {
			c.next = (i + 1) % len(c.slots) // the least recently used goes (resolveCache's rule)
			return append(dst, sl.names...), true
		}
	}
	return nil, false
}

// put remembers raw's decoded names (both copied: the caller's buffers are reused).
func (c *nameLists) put(raw []byte, names []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	sl := &c.slots[c.next]
	sl.raw, sl.names = append(sl.raw[:0], raw...), append(sl.names[:0], names...)
	if sl.names == nil {
		sl.names = []string{}
	}
	c.next = (c.next + 1) % len(c.slots)
}

// appendPlainStrings appends the strings of a JSON array of strings without escapes (node names
// never have any) to dst, each made by str from its bytes, in one pass; false for anything else.
// data is valid JSON (the decoder checked it).
func appendPlainStrings(dst []string, data []byte, str func([]byte) string) ([]string, bool) {
	i := 0
	ws := func() { i = skipJSONSpace(data, i) }
	ws()
	if i >= len(data) || data[i] != '[' {
		return nil, false
	}
	i++
	ws()
	if i < len(data) && data[i] == ']' {
		if dst == nil {
			dst = []string{}
		}
		return dst, true
	}
	for {
		ws()
		if i >= len(data) || data[i] != '"' {
			return nil, false
		}
		end := bytes.IndexByte(data[i+1:], '"')
		if end < 0 || !printableASCII(data[i+1:i+1+end]) {
			return nil, false
		}
		dst = append(dst, str(data[i+1:i+1+end]))
		i += end + 2
		ws()
		if i < len(data) && data[i] == ']' {
			return dst, true
		}
		if i >= len(data) || data[i] != ',' {
			return nil, false
		}
		i++
	}
}

// printableASCII reports whether b is printable ASCII without backslashes: a JSON string's content
// that decodes to itself (node names are DNS subdomains); anything else takes the standard decoder,
// which rejects control characters and replaces invalid UTF-8.
func printableASCII(b []byte) bool {
	for _, c := range b {
		if c < 0x20 || c >= utf8.RuneSelf || c == '\\' {
			return false
		}
	}
	return true
}

// splitNodeNames finds the node-name array of an extender-args object (the member whose key
// matches "NodeNames" as encoding/json matches keys, case-insensitively) and appends the object with
// that array replaced by null to rest: the standard decoder then validates and decodes only the
// small rest (the pod), and the array (most of the body) is read once, by nameList. ok is false
// for anything unusual (no such member, two of them, a key with escapes, a value that is not an
// array); the caller then decodes the whole body the standard way.
func splitNodeNames(body, rest []byte) (_, names []byte, ok bool) {
	i := 0
	ws := func() { i = skipJSONSpace(body, i) }
	ws()
	if i >= len(body) || body[i] != '{' {
		return nil, nil, false
	}
	i++
	from, to := -1, -1
	for {
		ws()
		if i >= len(body) || body[i] != '"' {
			return nil, nil, false
		}
		end := bytes.IndexByte(body[i+1:], '"')
		if end < 0 || bytes.IndexByte(body[i+1:i+1+end], '\\') >= 0 {
			return nil, nil, false
		}
		key := body[i+1 : i+1+end]
		i += end + 2
		ws()
		if i >= len(body) || body[i] != ':' {
			return nil, nil, false
		}
		i++
		ws()
		start := i
		if i = skipJSONValue(body, i); i < 0 {
			return nil, nil, false
		}
		if bytes.EqualFold(key, []byte("NodeNames")) {
			if from >= 0 || body[start] != '[' {
				return nil, nil, false
			}
			from, to = start, i
		}
		ws()
		if i < len(body) && body[i] == ',' {
			i++
			continue
		}
		if i >= len(body) || body[i] != '}' || from < 0 {
			return nil, nil, false
		}
		break
	}
	rest = append(append(append(rest, body[:from]...), "null"...), body[to:]...)
	return rest, body[from:to], true
}

// skipJSONValue returns the index just past the value at body[i] (-1 when it is cut short). It only
// finds the value's end; whether the value is valid JSON is for the decoder that reads it.
func skipJSONValue(body []byte, i int) int {
	depth := 0
	for i < len(body) {
		switch c := body[i]; c {
		case '"':
			// The closing quote is the first one after an even run of backslashes (an odd run
			// escapes it), found by IndexByte rather than byte by byte: a filter request's
			// node-name array is thousands of strings.
			for i++; ; {
				q := bytes.IndexByte(body[i:], '"')
				if q < 0 {
					return -1
				}
				i += q
				run := 0
				for body[i-1-run] == '\\' {
					run++
				}
				i++
				if run%2 == 0 {
					break
				}
			}
		case '{', '[':
			depth++
			i++
		case '}', ']':
			if depth == 0 {
				return i
			}
			depth--
			i++
		case ',':
			if depth == 0 {
				return i
			}
			i++
		default:
			i++
		}
		if depth == 0 && i < len(body) && (body[i-1] == '"' || body[i-1] == '}' || body[i-1] == ']') {
			return i
		}
	}
	if depth == 0 {
		return i
	}
	return -1
}

// skipJSONSpace returns the index of the first byte at or after i in b that is not JSON white space.
func skipJSONSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// nameSlices are node-name lists reused across filter and prioritize calls (5,000 names are 80 KB
// a call otherwise); a list goes back once the reply is written.
var nameSlices = sync.Pool{New: func() any { return new([]string) }}

// decodeArgs decodes filter's and prioritize's arguments (see argsWire); release gives the name
// list back to the pool once nothing reads args any more (after the reply).
func (x *Extender) decodeArgs(w http.ResponseWriter, r *http.Request, args *extenderv1.ExtenderArgs) (release func(), ok bool) {
	buf, err := readBody(r)
	defer bodies.Put(buf)
	pooled := nameSlices.Get().(*[]string)
	wire := argsWire{NodeNames: &nameList{state: x.State, recent: &x.names, names: *pooled}}
	if err == nil {
		rest := bodies.Get().(*bytes.Buffer)
		rest.Reset()
		if r, names, ok := splitNodeNames(buf.Bytes(), rest.AvailableBuffer()); ok {
			list := wire.NodeNames
			if err = list.UnmarshalJSON(names); err == nil {
				err = json.Unmarshal(r, &wire) // NodeNames is null there: wire.NodeNames becomes nil
				wire.NodeNames = list
			}
			rest.Write(r) // keep the grown buffer for the next call
		} else {
			err = json.Unmarshal(buf.Bytes(), &wire)
		}
		bodies.Put(rest)
	}
	args.Pod, args.Nodes = wire.Pod, wire.Nodes
	list := wire.NodeNames
	if list != nil && list.set {
		args.NodeNames = &list.names
	}
	release = func() {
		if list != nil && list.names != nil {
			clear(list.names) // no references to names kept by the pool
			*pooled = list.names[:0]
		}
		nameSlices.Put(pooled)
	}
	if !x.decoded(w, r, err) {
		release()
		return nil, false
	}
	return release, true
}

// encodeFilterReply writes a filter reply as encoding/json writes an ExtenderFilterResult (its
// keys), the reason maps from the call's per-node slices without per-entry allocations:
// encoding/json sorts map keys, allocates per entry and re-scans a Marshaler's output, which with
// thousands of refused nodes was the reply's main cost. Object members are unordered in JSON.
func encodeFilterReply(buf *bytes.Buffer, fr *filterReply) error {
	nodes, err := json.Marshal(fr.res.Nodes)
	if err != nil {
		return err
	}
	names, err := json.Marshal(fr.res.NodeNames)
	if err != nil {
		return err
	}
	out := buf.AvailableBuffer()
	out = append(append(append(out, `{"Nodes":`...), nodes...), `,"NodeNames":`...)
	out = append(append(out, names...), `,"FailedNodes":`...)
	out = fr.appendReasons(out, verdictFailed)
	out = append(out, `,"FailedAndUnresolvableNodes":`...)
	out = fr.appendReasons(out, verdictUnresolvable)
	out = append(appendJSONString(append(out, `,"Error":`...), fr.res.Error), "}\n"...)
	_, err = buf.Write(out)
	return err
}

// appendReasons writes the nodes with verdict v and their reasons as a JSON object.
func (fr *filterReply) appendReasons(out []byte, v uint8) []byte {
	out = append(out, '{')
	first := true
	// Reasons repeat (with --filter-pick-one every refused node shares one string): the last one's
	// encoding is copied instead of encoded again.
	var last string
	var lastAt, lastEnd int
	for i, name := range fr.names {
		if fr.verdict[i] != v {
			continue
		}
		if !first {
			out = append(out, ',')
		}
		out = appendJSONString(out, name)
		out = append(out, ':')
		if r := fr.reason[i]; !first && r == last {
			out = append(out, out[lastAt:lastEnd]...)
		} else {
			lastAt = len(out)
			out = appendJSONString(out, r)
			last, lastEnd = r, len(out)
		}
		first = false
	}
	return append(out, '}')
}

// appendJSONString appends s as a JSON string: quote, backslash and control characters escaped,
// invalid UTF-8 as U+FFFD (as encoding/json does).
func appendJSONString(out []byte, s string) []byte {
	out = append(out, '"')
	plain := true // printable ASCII without quote or backslash: copied as it is
	for i := 0; i < len(s) && plain; i++ {
		plain = s[i] >= 0x20 && s[i] < utf8.RuneSelf && s[i] != '"' && s[i] != '\\'
	}
	if plain {
		return append(append(out, s...), '"')
	}
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			out = append(out, '\\', byte(r))
		case r < 0x20:
			out = append(out, fmt.Sprintf("\\u%04x", r)...)
		default:
			out = utf8.AppendRune(out, r) // an invalid byte came out of range as U+FFFD
		}
	}
	return append(out, '"')
}

func (x *Extender) reply(w http.ResponseWriter, r *http.Request, v any) {
	start := time.Now()
	buf := bodies.Get().(*bytes.Buffer)
	buf.Reset()
	defer bodies.Put(buf)
	w.Header().Set("Content-Type", "application/json")
	var err error
	switch v := v.(type) {
	case *filterReply:
		err = encodeFilterReply(buf, v)
	case *extenderv1.ExtenderFilterResult: // the leader's answer, passed back
		err = encodeFilterReply(buf, replyOf(v))
	default:
		err = json.NewEncoder(buf).Encode(v)
	}
	if err == nil {
		_, err = w.Write(buf.Bytes())
	}
	if err != nil {
		x.log().Warn("write extender response", "path", r.URL.Path, "err", err)
	}
	x.log().Debug("served", "path", r.URL.Path, "encode", time.Since(start))
}
