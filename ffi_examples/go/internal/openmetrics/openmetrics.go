// Package openmetrics is a strict reader of the OpenMetrics text format, for the tests of the
// bindings and of serve-http: it checks the structure a Prometheus scraper relies on (as
// tests/common/openmetrics.rs does for the Rust side) and returns the samples.
package openmetrics

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Exposition is a parsed text.
type Exposition struct {
	// Types maps a family's name to its type ("counter", "gauge", "histogram", ...).
	Types map[string]string
	// Samples maps a sample's key (Key) to its value.
	Samples map[string]float64
}

// Key identifies a sample: its name and its labels sorted by name, as
// `name{a="x",b="y"}` (values unescaped), or just `name` without labels.
func Key(name string, labels map[string]string) string {
	if len(labels) == 0 {
		return name
	}
	names := make([]string, 0, len(labels))
	for k := range labels {
		names = append(names, k)
	}
	slices.Sort(names)
	var b strings.Builder
	b.WriteString(name)
	b.WriteByte('{')
	for i, k := range names {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s=%q", k, labels[k])
	}
	b.WriteByte('}')
	return b.String()
}

// Get returns the value of the sample name with exactly the labels given as name, value pairs.
func (e *Exposition) Get(name string, labels ...string) (float64, bool) {
	m := make(map[string]string, len(labels)/2)
	for i := 0; i+1 < len(labels); i += 2 {
		m[labels[i]] = labels[i+1]
	}
	v, ok := e.Samples[Key(name, m)]
	return v, ok
}

var suffixes = map[string][]string{
	"counter":        {"_total", "_created"},
	"histogram":      {"_bucket", "_count", "_sum", "_created"},
	"gaugehistogram": {"_bucket", "_gcount", "_gsum"},
	"summary":        {"", "_count", "_sum", "_created"},
	"info":           {"_info"},
	"gauge":          {""},
	"stateset":       {""},
	"unknown":        {""},
}

// Parse reads text, failing with the line number on any violation: every line ends with "\n";
// each family has at most one `# HELP` and one `# TYPE`, both before its samples, and its lines
// are contiguous; every sample follows a `# TYPE` and its name is the family's name with a
// suffix the type allows; label values are quoted and label names not repeated; values are
// numbers; no sample appears twice; `# EOF` appears once, as the last line.
func Parse(text string) (*Exposition, error) {
	e := &Exposition{Types: map[string]string{}, Samples: map[string]float64{}}
	if !strings.HasSuffix(text, "\n") {
		return nil, fmt.Errorf("the text does not end with a newline")
	}
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	seen := map[string]bool{} // families started (by HELP or TYPE)
	help := map[string]bool{}
	family, ftype := "", ""
	eof := false
	for i, line := range lines {
		at := func(format string, args ...any) error {
			return fmt.Errorf("line %d %q: %s", i+1, line, fmt.Sprintf(format, args...))
		}
		if eof {
			return nil, at("text after # EOF")
		}
		switch {
		case line == "# EOF":
			eof = true
		case strings.HasPrefix(line, "# HELP ") || strings.HasPrefix(line, "# TYPE "):
			rest := line[len("# HELP "):]
			name, arg, ok := strings.Cut(rest, " ")
			if !ok || !validName(name) {
				return nil, at("malformed metadata")
			}
			if name != family {
				if seen[name] {
					return nil, at("family %s appears twice (its lines must be contiguous)", name)
				}
				seen[name] = true
				family, ftype = name, ""
			}
			if strings.HasPrefix(line, "# HELP ") {
				if help[name] {
					return nil, at("second HELP for %s", name)
				}
				help[name] = true
				continue
			}
			if ftype != "" {
				return nil, at("second TYPE for %s", name)
			}
			if _, ok := suffixes[arg]; !ok {
				return nil, at("unknown type %q", arg)
			}
			ftype = arg
			e.Types[name] = arg
		case strings.HasPrefix(line, "#"):
			return nil, at("unknown comment")
		default:
			name, labels, value, err := sample(line)
			if err != nil {
				return nil, at("malformed sample: %v", err)
			}
			if ftype == "" {
				return nil, at("sample before its family's TYPE")
			}
			if !slices.ContainsFunc(suffixes[ftype], func(s string) bool { return name == family+s }) {
				return nil, at("sample %s does not belong to family %s (%s)", name, family, ftype)
			}
			key := Key(name, labels)
			if _, dup := e.Samples[key]; dup {
				return nil, at("duplicate sample")
			}
			e.Samples[key] = value
		}
	}
	if !eof {
		return nil, fmt.Errorf("the text does not end with # EOF")
	}
	return e, nil
}

func validName(s string) bool {
	for i, c := range s {
		if !(c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return s != ""
}

// sample parses `name{label="value",...} value [timestamp]`.
func sample(line string) (string, map[string]string, float64, error) {
	end := strings.IndexAny(line, "{ ")
	if end < 0 {
		return "", nil, 0, fmt.Errorf("no value")
	}
	name, rest := line[:end], line[end:]
	if !validName(name) {
		return "", nil, 0, fmt.Errorf("bad name %q", name)
	}
	labels := map[string]string{}
	if strings.HasPrefix(rest, "{") {
		rest = rest[1:]
		for !strings.HasPrefix(rest, "}") {
			if len(labels) > 0 {
				if !strings.HasPrefix(rest, ",") {
					return "", nil, 0, fmt.Errorf("labels not separated by a comma")
				}
				rest = rest[1:]
			}
			k, v, ok := strings.Cut(rest, "=")
			if !ok || !validName(k) || !strings.HasPrefix(v, `"`) {
				return "", nil, 0, fmt.Errorf("bad label at %q", rest)
			}
			val, after, err := quoted(v[1:])
			if err != nil {
				return "", nil, 0, err
			}
			if _, dup := labels[k]; dup {
				return "", nil, 0, fmt.Errorf("label %s repeated", k)
			}
			labels[k] = val
			rest = after
		}
		rest = rest[1:]
	}
	fields := strings.Split(rest, " ")
	if len(fields) < 2 || len(fields) > 3 || fields[0] != "" {
		return "", nil, 0, fmt.Errorf("expected one space, a value and an optional timestamp")
	}
	v, err := strconv.ParseFloat(fields[1], 64)
	if err != nil || math.IsNaN(v) && fields[1] != "NaN" {
		return "", nil, 0, fmt.Errorf("bad value %q", fields[1])
	}
	if len(fields) == 3 {
		if _, err := strconv.ParseFloat(fields[2], 64); err != nil {
			return "", nil, 0, fmt.Errorf("bad timestamp %q", fields[2])
		}
	}
	return name, labels, v, nil
}

// quoted reads a label value up to its closing quote (escapes: \\, \", \n) and returns it and
// what follows the quote.
func quoted(s string) (string, string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case '"':
			return b.String(), s[i+1:], nil
		case '\\':
			i++
			if i == len(s) {
				return "", "", fmt.Errorf("unterminated label value")
			}
			switch s[i] {
			case '\\', '"':
				b.WriteByte(s[i])
			case 'n':
				b.WriteByte('\n')
			default:
				return "", "", fmt.Errorf("bad escape \\%c", s[i])
			}
		default:
			b.WriteByte(c)
		}
	}
	return "", "", fmt.Errorf("unterminated label value")
}
